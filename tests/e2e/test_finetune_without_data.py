"""An sft-only spec with no top-level `data`, starting from a Hugging Face model directory, through the real
command line: `runyard plan` and `runyard run` take it (no data stage, the tokenizer the weights brought), the
verdict is the sft stage's own held-out figures (no unigram baseline, no pretraining held-out loss), the drift
reference is built from the stage's records, and the report shows chat prompts rendered with the model's
template, completed by the initial weights and by the export. A pretrain stage without `data` is refused,
naming the stage."""

from __future__ import annotations

import json

import pytest
import yaml

from runyard.data.chat import load_chat_template
from runyard.errors import EXIT_BAD_SPEC
from runyard.serve.drift import DriftReference

from .conftest import TINY_SPEC, merge, runyard
from .test_hf_directories import chats, transformers_directory

pytestmark = pytest.mark.slow

CHAT_PROMPT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "add 3 and 4"}]


def sft_only_spec(tmp_path, hf_dir, chats_path, **eval_fields):
    spec = merge(TINY_SPEC, {
        "name": "sft-only",
        "model": {"init": {"from": "hf", "path": str(hf_dir)}, "context_length": 32, "dropout": 0.0},
        "train": {"steps": 4, "batch_size": 4},
        "eval": {"interval": 2, "sample_tokens": 3, "temperature": 0, **eval_fields},
        "checkpoint": {"interval": 2},
        "stages": [{"name": "chat", "kind": "sft",
                    "data": {"sources": [{"path": str(chats_path)}], "heldout_fraction": 0.25},
                    "sft": {"task_prompts": 1, "samples": 1, "max_new_tokens": 2},
                    "gates": {"min_loss_drop": None}}],
    })
    del spec["data"]
    for key in ("d_model", "n_layers", "n_heads", "n_kv_heads"):
        spec["model"].pop(key, None)  # the weights' shape
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_an_sft_only_spec_without_data_runs_and_is_judged_on_its_own_figures(tmp_path):
    hf_dir = transformers_directory(tmp_path / "llama", "llama")
    spec = sft_only_spec(tmp_path, hf_dir, chats(tmp_path / "chats.jsonl", n=32),
                         prompts=["add ", CHAT_PROMPT], min_response_loss_drop=0.0)
    env = {"HF_HUB_OFFLINE": "1"}
    planned = runyard("plan", str(spec), "--no-calibrate", env=env)
    assert planned.returncode == 0, planned.stdout + planned.stderr

    run_dir = tmp_path / "run"
    ran = runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", env=env)
    assert ran.returncode in (0, 7), ran.stdout + ran.stderr
    assert "Traceback" not in ran.stderr, ran.stderr

    report = json.loads((run_dir / "eval" / "report.json").read_text())
    figures = json.loads((run_dir / "stages" / "chat" / "finetune.json").read_text())
    before, after = figures["before"]["metrics"]["heldout_loss"], figures["after"]["metrics"]["heldout_loss"]
    # Judged on the stage's own response loss against its initial weights', and on nothing else.
    assert report["metrics"] is None
    assert report["fit_to_ship"] == (after < before) == (ran.returncode == 0)
    judged = report["passed"] + report["reasons"]
    assert any(f"held-out response loss {after:.4f}" in line and f"{before:.4f}" in line for line in judged), judged
    assert not any("unigram" in line for line in judged)
    markdown = (run_dir / "eval" / "report.md").read_text()
    assert "No top-level data" in markdown and "unigram baseline loss" not in markdown

    # No top-level data stage ran: the manifest names the weights' tokenizer.
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["data"]["top_level"] is None
    assert manifest["data"]["tokenizer"] == str(hf_dir / "tokenizer.json")

    # The drift reference comes from the sft records, and the report says so.
    assert any("drift reference: the" in note and "stage chat (sft)" in note for note in report["notes"])
    reference = DriftReference.load(run_dir / "export")
    assert reference.token_counts.sum() > 0

    # A text prompt as it is; the chat prompt rendered with the model's template, before and after.
    text, chat = report["samples"]
    assert text["prompt"] == "add " and "before" in text
    assert chat["prompt"] == CHAT_PROMPT
    assert chat["rendered"] == load_chat_template(hf_dir).render(CHAT_PROMPT, add_generation_prompt=True)
    assert chat["rendered"].endswith("<|assistant|>")
    assert isinstance(chat["before"], str) and isinstance(chat["completion"], str)
    assert chat["rendered"] in markdown and "Initial weights:" in markdown and "After training:" in markdown


def test_a_pretrain_stage_without_data_is_refused_naming_it(tmp_path):
    hf_dir = transformers_directory(tmp_path / "llama", "llama")
    spec = sft_only_spec(tmp_path, hf_dir, chats(tmp_path / "chats.jsonl"))
    raw = yaml.safe_load(spec.read_text())
    raw["stages"].insert(0, {"name": "warm", "gates": {"min_loss_drop": None}})
    spec.write_text(yaml.safe_dump(raw))
    for verb in (("plan", str(spec), "--no-calibrate"), ("run", str(spec), "--run-dir", str(tmp_path / "run"))):
        proc = runyard(*verb, env={"HF_HUB_OFFLINE": "1"})
        assert proc.returncode == EXIT_BAD_SPEC, proc.stdout + proc.stderr
        assert "data: got '(missing)'; stage 'warm' has kind pretrain" in proc.stderr, proc.stderr
