"""The two halves of issue 11 together, through the real command line: a run starts from a Hugging Face
Llama directory (random weights saved by the test, with a chat template in its tokenizer_config.json),
instruction-tunes it with LoRA on chat records rendered with that template, and exports a Hugging Face
directory that transformers loads: runyard's logits, the chat template it trained with, and every
tensor LoRA did not target bitwise the source's."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml
from safetensors.torch import load_file

from runyard.data.chat import ChatTemplate
from runyard.model.hf.export import load_export
from runyard.train.finetune_metrics import read_record
from tests.model.hf_models import hf_model, save_hf_model

from .conftest import TINY_SPEC, merge, runyard

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_finetune_from_hf")]  # one run (module fixture)

# ChatML-like, ending each assistant turn with the tokenizer's eos_token (`</s>`), as many models' do.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
LORA_TARGETS = ["q_proj", "v_proj"]


def chats(n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"add {i % 7} and {i % 5}"},
                          {"role": "assistant", "content": str(i % 7 + i % 5)}]} for i in range(n)]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft-from-hf")
    hf_dir = save_hf_model(hf_model("llama", vocab_size=320, seed=11), tmp / "llama")
    tok_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({**tok_config, "chat_template": TEMPLATE}))
    data = tmp / "chats.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in chats(40)))
    spec = merge(TINY_SPEC, {
        "name": "sft-from-hf",
        "data": {"sources": [{"path": "{stdlib}/json/*.py"}]},
        "model": {"init": {"from": "hf", "path": str(hf_dir)}, "context_length": 64, "dropout": 0.0},
        "train": {"steps": 4, "batch_size": 4},
        "eval": {"interval": 2, "final_batches": 2},
        "checkpoint": {"interval": 2},
        "stages": [{
            "name": "chat", "kind": "sft",
            "data": {"sources": [{"path": str(data)}], "heldout_fraction": 0.2},
            "lora": {"rank": 4, "alpha": 8, "targets": LORA_TARGETS},
            "sft": {"task_prompts": 2, "samples": 1, "max_new_tokens": 4},
            "gates": {"min_loss_drop": None},
        }],
    })
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
        spec["model"].pop(key, None)  # the weights' shape
    spec_path = tmp / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(spec))
    run_dir = tmp / "run"
    proc = runyard("run", str(spec_path), "--run-dir", str(run_dir), "--no-progress", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return hf_dir, run_dir


def test_the_instruction_data_is_rendered_with_the_weights_chat_template(tuned):
    hf_dir, run_dir = tuned
    report = json.loads((run_dir / "data" / "chat" / "report.json").read_text())
    assert report["chat_template"]["source"] == TEMPLATE
    assert report["chat_template"]["origin"] == str(hf_dir / "tokenizer_config.json")
    record = read_record(run_dir / "stages" / "chat")
    assert record["before"]["metrics"]["heldout_loss"] > record["after"]["metrics"]["heldout_loss"]


def test_the_export_loads_in_transformers_with_its_chat_template_and_runyards_logits(tuned):
    hf_dir, run_dir = tuned
    export = run_dir / "export"
    tok_config = json.loads((export / "tokenizer_config.json").read_text())
    assert (export / "chat_template.jinja").read_text() == TEMPLATE and tok_config["eos_token"] == "</s>"
    assert "chat_template" not in tok_config  # where transformers 5 reads it, as its save_pretrained writes it
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "add 2 and 3"}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == "<|user|>\nadd 2 and 3\n<|assistant|>\n"
    turn = [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "5"}]
    runyards = ChatTemplate(TEMPLATE, "test", (("bos_token", "<s>"), ("eos_token", "</s>")))
    assert tokenizer.apply_chat_template(turn, tokenize=False) == runyards.render(turn)  # what it trained on

    ours, cfg, _tok = load_export(export)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    idx = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)


def test_lora_changed_its_targets_only_and_the_rest_is_the_source_bitwise(tuned):
    hf_dir, run_dir = tuned
    source, exported = load_file(hf_dir / "model.safetensors"), load_file(run_dir / "export" / "model.safetensors")
    assert exported.keys() == source.keys()
    targeted = [k for k in source if any(f".{t}." in k for t in LORA_TARGETS)]
    assert len(targeted) == 2 * 2  # two projections in each of two layers
    for name, tensor in source.items():
        if name in targeted:
            assert not torch.equal(exported[name], tensor), f"{name}: the merged adapters changed nothing"
        else:
            assert torch.equal(exported[name], tensor), f"{name} is not a LoRA target but changed"
