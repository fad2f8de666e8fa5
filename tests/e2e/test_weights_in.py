"""A run that starts from a Hugging Face model directory, through the real command line: its data is
tokenized with the model's tokenizer (no BPE trained), a second stage continues the first, and the
export is a Hugging Face directory that transformers loads with runyard's logits. A spec that contradicts
its weights exits 2 before any work."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
import yaml

from runyard.errors import EXIT_BAD_SPEC
from runyard.model.hf.export import load_export
from runyard.train import checkpoint as ckpt
from tests.model.hf_models import hf_model, save_hf_model

from .conftest import TINY_SPEC, merge, runyard

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("e2e_weights_in")]  # one run (module fixture)


def write(tmp_path, hf_dir, **model):
    spec = merge(TINY_SPEC, {
        "name": "from-hf",
        "data": {"sources": [{"path": "{stdlib}/json/*.py"}]},
        "model": {"init": {"from": "hf", "path": str(hf_dir)}, "context_length": 32, "dropout": 0.0, **model},
        "train": {"steps": 4, "batch_size": 4},
        "eval": {"interval": 2, "final_batches": 2},
        "checkpoint": {"interval": 2},
        "stages": [{"name": "continue", "gates": {"min_loss_drop": None}},
                   {"name": "more", "model": {"init": {"from": "stage", "name": "continue"}},
                    "gates": {"min_loss_drop": None}}],
    })
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
        spec["model"].pop(key, None)  # the weights' shape
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("hf-run")
    hf_dir = save_hf_model(hf_model("llama", vocab_size=320, seed=5), tmp_path / "llama")
    run_dir = tmp_path / "run"
    proc = runyard("run", str(write(tmp_path, hf_dir)), "--run-dir", str(run_dir), "--no-progress",
                   env={"HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return hf_dir, run_dir


def test_the_data_is_tokenized_with_the_models_tokenizer(hf_run):
    hf_dir, run_dir = hf_run
    report = json.loads((run_dir / "data" / "report.json").read_text())
    tokenizer = report["tokenizer"]
    assert tokenizer["source"] == str(hf_dir / "tokenizer.json") and tokenizer["requested_vocab_size"] is None
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer["eos_id"] == hf_tok.convert_tokens_to_ids("</s>") and tokenizer["vocab_size"] == len(hf_tok)
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["init_weights"]["continue"]["from"] == "hf"
    assert set(manifest["init_weights"]["continue"]["sha256"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert manifest["init_weights"]["more"] == {"from": "stage", "stage": "continue"}


def test_the_export_is_a_hugging_face_directory_with_runyards_logits(hf_run):
    hf_dir, run_dir = hf_run
    export = run_dir / "export"
    ours, cfg, _tok = load_export(export)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    assert json.loads((export / "config.json").read_text())["max_position_embeddings"] == 64  # the weights' context
    assert json.loads((export / "tokenizer_config.json").read_text()) == json.loads(
        (hf_dir / "tokenizer_config.json").read_text())
    idx = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=0, atol=1e-5)
    # The export is the last stage's final weights, which started where the first stage ended.
    final = ckpt.read_model_weights(ckpt.latest_good(run_dir / "stages" / "more" / "checkpoints").path)
    assert torch.equal(ours.state_dict()["blocks.1.ffn.w_down.weight"], final["blocks.1.ffn.w_down.weight"])
    generated = runyard("generate", str(run_dir), "--prompt", "import ", "--max-tokens", "4", "--seed", "1")
    assert generated.returncode == 0 and generated.stdout.startswith("import"), generated.stderr


def test_a_spec_that_contradicts_its_weights_exits_2_before_any_work(tmp_path, hf_run):
    hf_dir, _ = hf_run
    run_dir = tmp_path / "run"
    proc = runyard("run", str(write(tmp_path, hf_dir, context_length=128, vocab_size=500)), "--run-dir",
                   str(run_dir), "--no-progress")
    assert proc.returncode == EXIT_BAD_SPEC, proc.stderr
    assert "model.context_length: got 128" in proc.stderr and "max_position_embeddings = 64" in proc.stderr
    assert "model.vocab_size: got 500" in proc.stderr and f"{hf_dir}/config.json" in proc.stderr
    assert not run_dir.exists() and "Traceback" not in proc.stderr
