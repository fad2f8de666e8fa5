"""Model directories written by the installed transformers' save_pretrained (chat template in
chat_template.jinja), through the real command line: an sft stage on `messages` renders with that template
(it failed: "no chat template was found"), a continued-pretraining run exports the model with it (it
dropped it), and both exports keep their architecture (Mistral, Qwen2) with its fields; transformers'
apply_chat_template on the export equals what runyard serves. Each damaged directory, and a missing
template an sft stage on `messages` needs, exits 2 from `runyard plan` and `runyard run`, naming the file,
before the run directory holds anything."""

from __future__ import annotations

import json
import re

import pytest
import transformers
import yaml

from runyard.data.chat import load_chat_template
from runyard.errors import EXIT_BAD_SPEC
from tests.model.hf_models import hf_model, write_tokenizer
from tests.model.test_hf_directories import CHAT, TEMPLATE, damage

from .conftest import TINY_SPEC, merge, runyard

pytestmark = pytest.mark.slow


def transformers_directory(directory, case: str, template: str | None = TEMPLATE, **config):
    """A model and its tokenizer as the installed transformers' save_pretrained writes them."""
    hf_model(case, vocab_size=320, seed=3, **config).save_pretrained(directory)
    write_tokenizer(directory / ".tokenizer-source")
    tok = transformers.AutoTokenizer.from_pretrained(directory / ".tokenizer-source")
    tok.chat_template = template
    tok.save_pretrained(directory)
    return directory


def chats(path, n: int = 24):
    path.write_text("".join(json.dumps({"messages": [
        {"role": "user", "content": f"add {i % 7} and {i % 5}"},
        {"role": "assistant", "content": str(i % 7 + i % 5)}]}) + "\n" for i in range(n)))
    return path


def write_spec(tmp_path, hf_dir, sft_data=None):
    stages = [{"name": "continue", "gates": {"min_loss_drop": None}}]
    if sft_data is not None:
        stages = [{"name": "chat", "kind": "sft", "data": {"sources": [{"path": str(sft_data)}], "heldout_fraction": 0.2},
                   "sft": {"task_prompts": 1, "samples": 1, "max_new_tokens": 2}, "gates": {"min_loss_drop": None}}]
    spec = merge(TINY_SPEC, {
        "name": "hf-dirs",
        "data": {"sources": [{"path": "{stdlib}/json/*.py"}]},
        "model": {"init": {"from": "hf", "path": str(hf_dir)}, "context_length": 32, "dropout": 0.0},
        "train": {"steps": 2, "batch_size": 4},
        "eval": {"interval": 2, "final_batches": 1, "sample_tokens": 2},
        "checkpoint": {"interval": 2},
        "stages": stages,
    })
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
        spec["model"].pop(key, None)  # the weights' shape
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def run(tmp_path, spec):
    run_dir = tmp_path / "run"
    proc = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir


def assert_template_served_as_transformers_renders(export):
    assert (export / "chat_template.jinja").read_text() == TEMPLATE
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    served = load_chat_template(export)  # what `runyard serve` renders with
    assert tokenizer.apply_chat_template(CHAT, tokenize=False) == served.render(CHAT)
    assert tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True) == served.render(
        CHAT[:2], add_generation_prompt=True)


def test_sft_on_messages_from_a_transformers_5_mistral_keeps_its_template_and_class(tmp_path):
    hf_dir = transformers_directory(tmp_path / "mistral", "mistral", sliding_window=64)
    run_dir = run(tmp_path, write_spec(tmp_path, hf_dir, sft_data=chats(tmp_path / "chats.jsonl")))
    report = json.loads((run_dir / "data" / "chat" / "report.json").read_text())
    assert report["chat_template"] == {"origin": str(hf_dir / "chat_template.jinja"), "source": TEMPLATE}
    config = json.loads((run_dir / "export" / "config.json").read_text())
    assert config["architectures"] == ["MistralForCausalLM"] and config["model_type"] == "mistral"
    assert config["sliding_window"] == 64
    assert_template_served_as_transformers_renders(run_dir / "export")
    assert type(transformers.AutoModelForCausalLM.from_pretrained(run_dir / "export")).__name__ == "MistralForCausalLM"


def test_continued_pretraining_of_a_transformers_5_qwen2_exports_its_template_and_fields(tmp_path):
    hf_dir = transformers_directory(tmp_path / "qwen2", "qwen2")
    run_dir = run(tmp_path, write_spec(tmp_path, hf_dir))
    came_in = json.loads((hf_dir / "config.json").read_text())
    went_out = json.loads((run_dir / "export" / "config.json").read_text())
    assert went_out["architectures"] == ["Qwen2ForCausalLM"]
    for field in ("layer_types", "max_window_layers", "use_sliding_window", "sliding_window"):
        assert went_out[field] == came_in[field], field
    assert_template_served_as_transformers_renders(run_dir / "export")


BAD = {
    "pickle-only": r"pytorch_model\.bin: holds the weights as a pickle.*convert it to safetensors",
    "header-beyond-file": r"model\.safetensors: is truncated: its header says",
    "tensor-beyond-file": r"model\.safetensors: is truncated: tensor",
    "unreadable-header": r"model\.safetensors: is not a readable safetensors file",
    "missing-tensor": r"lack 1 tensor\(s\) config\.json implies",
    "no-tokenizer": r"tokenizer\.json is missing",
    "no-template": r"stages\[0\]\.data\.chat_template.*records give `messages` \(.*chats\.jsonl:1\).*has no chat_template\.jinja",
}


# Every kind is checked in-process (tests/model/test_hf_directories.py); through the command line the fast
# tier keeps one damaged weights file and one missing template, the full tier every kind.
FAST_BAD = ("pickle-only", "no-template")


@pytest.mark.parametrize("how", [how if how in FAST_BAD else pytest.param(how, marks=pytest.mark.full)
                                 for how in sorted(BAD)])
def test_a_bad_directory_exits_2_from_plan_and_run_before_any_work(tmp_path, how):
    hf_dir = transformers_directory(tmp_path / "llama", "llama", template=None if how == "no-template" else TEMPLATE)
    if how == "no-tokenizer":
        (hf_dir / "tokenizer.json").unlink()
    elif how != "no-template":
        damage(hf_dir, how)
    spec = write_spec(tmp_path, hf_dir, sft_data=chats(tmp_path / "chats.jsonl") if how == "no-template" else None)
    planned = runyard("plan", str(spec), "--no-calibrate", env={"HF_HUB_OFFLINE": "1"})
    assert planned.returncode == EXIT_BAD_SPEC, planned.stdout + planned.stderr
    assert re.search(BAD[how], planned.stderr, re.S) and "Traceback" not in planned.stderr, planned.stderr
    run_dir = tmp_path / "run"
    ran = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", env={"HF_HUB_OFFLINE": "1"})
    assert ran.returncode == EXIT_BAD_SPEC, ran.stdout + ran.stderr
    assert re.search(BAD[how], ran.stderr, re.S) and "Traceback" not in ran.stderr, ran.stderr
    assert not run_dir.exists() or not any(run_dir.iterdir())
