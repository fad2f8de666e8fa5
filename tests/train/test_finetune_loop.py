"""sft and dpo stages through the real loop, in-process: the loss covers responses only, the before/after
record is written, LoRA trains adapters alone, and a stage stopped by SIGTERM mid-way and resumed ends
bitwise equal to one that never stopped."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runyard.errors import Preempted
from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import checkpoint, parallel
from runyard.train.finetune_metrics import read_record
from runyard.train.loop import final_stage_model, train_stage

from .finetune_fixtures import (
    function_pairs,
    prepare,
    prepared_text,
    write_dpo_jsonl,
    write_sft_jsonl,
    write_tokenizer,
)
from .test_loop_resume import StopAtStep, metric_rows

CTX = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
CONTEXT = 256


def spec_for(kind: str, data_path: Path, lora: dict | None = None, steps: int = 8):
    stage = {"name": "tune", "kind": kind, "data": {"sources": [{"path": str(data_path), "group_field": None}],
                                                     "heldout_fraction": 0.2, "too_long": "truncate"},
             "gates": {"min_loss_drop": None}, "sft": {"task_prompts": 2, "samples": 1, "max_new_tokens": 8}}
    if lora:
        stage["lora"] = lora
    if kind == "dpo":
        stage["model"] = {"dropout": 0.0}  # so the policy equals the reference exactly at the first step
    return parse_spec({
        "name": "ft", "seed": 11, "data": {"sources": [{"path": "unused"}]},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": CONTEXT,
                  "dropout": 0.1},
        "optim": {"lr": 0.01}, "schedule": {"warmup_steps": 2},
        "train": {"steps": steps, "batch_size": 4, "grad_accum": 2},
        "eval": {"interval": 3, "batches": 2},
        "checkpoint": {"interval": 2, "keep_last": 2},
        "stages": [stage],
        "resources": {"device": "cpu"},
    })


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft")
    tok = write_tokenizer(root / "tokenizer.json")
    pairs = function_pairs()
    return {"root": root, "tok": tok, "sft": write_sft_jsonl(root / "sft.jsonl", pairs),
            "dpo": write_dpo_jsonl(root / "dpo.jsonl", pairs)}


def run(spec, files, kind: str, out: Path, stop=None):
    stage = resolved_stage(spec, "tune")
    vocab = 400
    instruct = prepare(stage.data.model_dump(), kind, files["tok"], CONTEXT, files["root"] / "cache")
    return train_stage(spec, stage, prepared_text(files["tok"], vocab), out, CTX, stop=stop, show_progress=False,
                       instruct=instruct)


@pytest.mark.slow
def test_sft_stage_trains_on_responses_and_records_before_and_after(files, tmp_path):
    torch.set_num_threads(1)
    spec = spec_for("sft", files["sft"], steps=10)
    result = run(spec, files, "sft", tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert all(0 <= r["padding_fraction"] < 1 for r in rows)
    assert rows[-1]["heldout_response_tokens"] > 0
    record = read_record(tmp_path)
    assert record["kind"] == "sft"
    assert record["before"]["metrics"]["heldout_loss"] > record["after"]["metrics"]["heldout_loss"]
    assert "task_exact_match" in record["after"]["metrics"]
    assert len(record["before"]["samples"]) == 1 and record["before"]["samples"][0]["reference"]
    assert result.checkpointed_module is result.model


@pytest.mark.slow
def test_sigterm_mid_sft_with_lora_resumes_bitwise(files, tmp_path):
    torch.set_num_threads(1)
    spec = spec_for("sft", files["sft"], lora={"rank": 4, "alpha": 8, "dropout": 0.1,
                                               "targets": ["q_proj", "v_proj", "up_proj"]})
    reference = run(spec, files, "sft", tmp_path / "reference")
    stopped = tmp_path / "stopped"
    with pytest.raises(Preempted, match="at step 5"):
        run(spec, files, "sft", stopped, stop=StopAtStep(stopped / "metrics.jsonl", 5))
    resumed = run(spec, files, "sft", stopped)
    assert resumed.resumed_from == 5
    assert metric_rows(stopped) == metric_rows(tmp_path / "reference")
    final = checkpoint.read_model_weights(checkpoint.latest_good(stopped / "checkpoints").path)
    assert final.keys() == reference.checkpointed_module.state_dict().keys()
    assert all(".lora." not in k and k.startswith("adapters.") for k in final), "only adapters are checkpointed"
    for name, tensor in reference.checkpointed_module.state_dict().items():
        assert torch.equal(final[name], tensor), name
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(resumed.model.state_dict()[name], tensor), name
    stage = resolved_stage(spec, "tune")
    rebuilt, _ = final_stage_model(spec, stage, prepared_text(files["tok"], 400), CTX,
                                   checkpoint.latest_good(stopped / "checkpoints").path, None)
    for name, tensor in reference.model.state_dict().items():
        assert torch.equal(rebuilt.state_dict()[name], tensor), name


@pytest.mark.slow
@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8}])
def test_dpo_stage_learns_to_prefer_the_chosen_response(files, tmp_path, lora):
    torch.set_num_threads(1)
    spec = spec_for("dpo", files["dpo"], lora=lora, steps=9)
    run(spec, files, "dpo", tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward_margin"] == pytest.approx(0.0, abs=1e-6), "policy == reference at the first step"
    assert rows[-1]["reward_margin"] > 0
    held = [r for r in rows if "heldout_reward_accuracy" in r]
    assert held and 0 <= held[-1]["heldout_reward_accuracy"] <= 1
    record = read_record(tmp_path)
    assert record["before"]["metrics"]["heldout_reward_margin"] == pytest.approx(0.0, abs=1e-6)
