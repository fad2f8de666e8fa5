"""Pipeline parallel (resources.parallel: {pp: 2}) through the real command line: two torchrun workers on
CPU with gloo, each holding two of the decoder's four blocks (embeddings on the first, final norm and head
on the last), driven by torch.distributed.pipelining's Schedule1F1B or ScheduleGPipe with two micro-batches
of accumulation. Per-step losses, gradient norms and held-out losses equal the one-process run within fp32
tolerance; the gates pass and the export is written from the model gathered to rank 0; the checkpoint
holds the whole model under its own names, so a one-process job resumes it (pp 2 -> 1) and ends on the
one-process curve. An sft stage (masks, records of uneven supervised counts, rows padded to the stage's
context so the stages exchange one shape) trains under pp 2 as in one process: the schedule's loss skips the
ignore index and is scaled by the step's global supervised count, so its per-step losses, held-out response
losses and step-1 gradients are the one-process run's. A layout or a stage pipeline parallel does not train
(dpo, LoRA) is refused naming the field."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from runyard.spec.job import parse_spec, resolved_stage
from runyard.train import checkpoint as ckpt
from runyard.train import parallel, pipeline

from .conftest import TINY_SPEC, merge, runyard, shared_once
from .test_tensor_parallel import first_moments
from .uneven_records import sft_stage_patch, write_uneven_records

STEPS = 12
SPEC = {
    "model": {"dropout": 0.0, "n_layers": 4, "tie_embeddings": False},
    "train": {"steps": STEPS, "batch_size": 4, "grad_accum": 2},
    "stages": [{"name": "main", "gates": {"min_loss_drop": None}}],
    "eval": {"interval": 6},
    "checkpoint": {"interval": 3, "keep_last": 10},
}


def run(tmp: Path, name: str, patch: dict, *extra: str, verb: str = "train") -> Path:
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, SPEC), patch)))
    runyard(verb, str(spec), "--run-dir", str(tmp / name), "--no-progress", *extra, check=True, timeout=400)
    return tmp / name


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages/main/metrics.jsonl").read_text().splitlines()]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return ckpt.read_model_weights(ckpt.latest_good(run_dir / "stages/main/checkpoints").path)


def assert_same_curve(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b, strict=True):
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5), ra["step"]
        assert rb["grad_norm"] == pytest.approx(ra["grad_norm"], rel=1e-4), ra["step"]
        assert ("heldout_loss" in ra) == ("heldout_loss" in rb), ra["step"]
        if "heldout_loss" in ra:
            assert rb["heldout_loss"] == pytest.approx(ra["heldout_loss"], rel=1e-5), ra["step"]


def assert_same_weights(w1: dict, w2: dict) -> None:
    assert w1.keys() == w2.keys()
    for name in w1:
        assert torch.allclose(w1[name], w2[name], rtol=0, atol=1e-4), name


# Made once per session, whichever xdist worker asks first (shared_once); read only.
@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> Path:
    return shared_once(tmp_path_factory, "pp-one", lambda root: run(root, "one", {})) / "one"


@pytest.fixture(scope="session")
def pp_1f1b(tmp_path_factory) -> Path:
    # `run`: also the final evaluation and the export, from the whole model gathered to rank 0
    def make(root: Path) -> None:
        run(root, "pp", {"resources": {"parallel": {"pp": 2}}}, "--nproc", "2", verb="run")

    return shared_once(tmp_path_factory, "pp-1f1b", make) / "pp"


@pytest.mark.slow
def test_two_stages_under_1f1b_match_one_process(one_process, pp_1f1b):
    assert_same_curve(rows(one_process), rows(pp_1f1b))
    assert len(rows(one_process)) == STEPS
    gates = json.loads((pp_1f1b / "stages/main/gates.json").read_text())
    assert gates["passed"], gates  # judged on the whole model gathered to rank 0 against its checkpoint
    assert_same_weights(weights(one_process), weights(pp_1f1b))  # every stage's tensors, under global names
    exported = load_file(pp_1f1b / "export/model.safetensors")  # Hugging Face names, Q/K/V split
    trained = weights(pp_1f1b)
    assert sum(t.numel() for t in exported.values()) == sum(t.numel() for t in trained.values())
    assert torch.equal(exported["model.embed_tokens.weight"], trained["tok_emb.weight"])  # first stage's
    assert torch.equal(exported["lm_head.weight"], trained["lm_head.weight"])  # last stage's


@pytest.mark.slow
@pytest.mark.full  # fast tier: the 1F1B schedule (the same stages, interleaved)
def test_two_stages_under_gpipe_with_four_microbatches_match_one_process(one_process, tmp_path):
    pp = run(tmp_path, "gpipe", {"resources": {"parallel": {"pp": 2, "pp_schedule": "gpipe", "pp_microbatches": 4}}},
             "--nproc", "2")
    assert_same_curve(rows(one_process), rows(pp))
    assert_same_weights(weights(one_process), weights(pp))


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_on_one_process(one_process, pp_1f1b, tmp_path):
    """pp 2 -> 1: the one-process job finds the two-stage job's step-6 checkpoint (model, optimizer, loader
    position) and ends on the one-process curve."""
    resumed = tmp_path / "resumed"
    (resumed / "stages/main/checkpoints").mkdir(parents=True)
    for ref in ckpt.list_checkpoints(pp_1f1b / "stages/main/checkpoints"):
        if ref.step == 6:
            shutil.copytree(ref.path, resumed / "stages/main/checkpoints" / ref.path.name)
    lines = (pp_1f1b / "stages/main/metrics.jsonl").read_text().splitlines()
    (resumed / "stages/main/metrics.jsonl").write_text("\n".join(lines[:6]) + "\n")
    assert [r.step for r in ckpt.list_checkpoints(resumed / "stages/main/checkpoints")] == [6]
    run(tmp_path, "resumed", {})
    assert rows(resumed)[6]["step"] == 7
    assert_same_curve(rows(one_process), rows(resumed))
    assert_same_weights(weights(one_process), weights(resumed))


@pytest.mark.slow
@pytest.mark.full  # fast tier: sft masks across processes (test_finetune_run, DDP); 1F1B trains (above)
def test_an_sft_stage_under_1f1b_matches_one_process(tmp_path):
    """Masks under pp 2, 20 steps of two accumulated batches, each run by 1F1B in two chunks whose supervised
    counts differ: the one-process losses, held-out response losses, padding and step-1 gradients."""
    # every step checkpointed and kept: step 1's holds the first gradients
    patch = merge(sft_stage_patch(write_uneven_records(tmp_path / "records.jsonl")),
                  {"train": {"steps": 20}, "eval": {"interval": 5}, "checkpoint": {"interval": 1, "keep_last": 20}})
    one = run(tmp_path, "one", patch, verb="run")  # `run`: the export tells the model's shape
    pp = run(tmp_path, "pp", merge(patch, {"resources": {"parallel": {"pp": 2}}}), "--nproc", "2", verb="run")
    ra, rb = rows(one), rows(pp)
    assert [r["step"] for r in ra] == list(range(1, 21))
    assert_same_curve(ra, rb)
    assert all(0 < r["padding_fraction"] < 1 for r in ra)  # padded as one process pads, not to the context
    assert [r["padding_fraction"] for r in ra] == pytest.approx([r["padding_fraction"] for r in rb], rel=1e-12)
    assert [r["tokens"] for r in ra] == [r["tokens"] for r in rb]
    assert any(r.get("heldout_response_tokens", 0) > 0 for r in rb)
    ga, gb = first_moments(one, tmp_path / "one.yaml"), first_moments(pp, tmp_path / "pp.yaml")
    assert ga.keys() == gb.keys() and len(ga) > 4  # both stages' parameters, under the whole model's names
    for name in ga:
        assert ga[name].abs().sum() > 0, name
        assert torch.allclose(ga[name], gb[name], rtol=1e-4, atol=1e-6), name
    assert_same_weights(weights(one), weights(pp))
    assert json.loads((pp / "stages/main/gates.json").read_text())["passed"]
    # the before/after record: the whole model gathered to rank 0 at the stage's start and end
    fa, fb = (json.loads((d / "stages/main/finetune.json").read_text()) for d in (one, pp))
    assert fb["parameters"] == fa["parameters"]
    for when in ("before", "after"):
        assert fb[when]["metrics"]["heldout_loss"] == pytest.approx(fa[when]["metrics"]["heldout_loss"], rel=1e-5)


def test_a_batch_is_padded_to_the_one_shape_the_stages_exchange():
    x, y = torch.tensor([[5, 6, 7]]), torch.tensor([[6, 7, -100]])
    px, py = pipeline.fixed_shape(x, y, 2, 5)
    assert px.tolist() == [[5, 6, 7, 0, 0], [0, 0, 0, 0, 0]]
    assert py.tolist() == [[6, 7, -100, -100, -100], [-100] * 5]  # padding supervises nothing
    assert pipeline.fixed_shape(px, py, 2, 5)[0] is px
    with pytest.raises(ValueError, match="does not fit"):
        pipeline.fixed_shape(px, py, 2, 4)


# -- refusals, by the field that asks (no processes needed) ----------------------------------------------
def spec_with(patch: dict):
    return parse_spec(merge(merge(TINY_SPEC, SPEC), patch))


def test_a_layout_that_does_not_fill_the_world_or_mixes_pp_with_tp_is_refused_by_name():
    with pytest.raises(parallel.LayoutError, match=r"dp_replicate x dp_shard x tp x pp"):
        parallel.layout_of(spec_with({"resources": {"parallel": {"pp": 2}}}).resources.parallel, 3)
    with pytest.raises(parallel.LayoutError, match=r"pipeline parallel \(pp 2\) is not yet combined"):
        parallel.layout_of(spec_with({"resources": {"parallel": {"pp": 2, "tp": 2}}}).resources.parallel, 4)
    from runyard.errors import SpecError

    with pytest.raises(SpecError, match=r"pp_microbatches"):
        spec_with({"resources": {"parallel": {"pp_microbatches": 2}}})
    with pytest.raises(SpecError, match=r"pp_microbatches \(1\) must be at least"):
        spec_with({"resources": {"parallel": {"pp": 2, "pp_microbatches": 1}}})


@pytest.mark.parametrize("patch, field", [
    ({"train": {"activation_checkpointing": "full"}}, "train.activation_checkpointing"),
    ({"resources": {"compile": True}}, "resources.compile"),
    ({"resources": {"parallel": {"pp": 2, "pp_microbatches": 3}}}, "train.batch_size"),
])
def test_what_pipeline_parallel_does_not_train_is_refused_by_name(patch, field):
    spec = spec_with(merge({"resources": {"parallel": {"pp": 2}}}, patch))
    layout = parallel.layout_of(spec.resources.parallel, 2)
    with pytest.raises(parallel.LayoutError, match=field.replace(".", r"\.")):
        pipeline.refuse_unsupported(resolved_stage(spec, "main"), spec.resources, layout)


def test_dpo_and_lora_stages_are_refused_under_pipeline_parallel():
    spec = spec_with({"resources": {"parallel": {"pp": 2}}})
    layout = parallel.layout_of(spec.resources.parallel, 2)
    stage = resolved_stage(spec, "main")
    with pytest.raises(parallel.LayoutError, match="pretrain and sft stages, not dpo"):
        pipeline.refuse_unsupported(stage.model_copy(update={"kind": "dpo"}), spec.resources, layout)
    with pytest.raises(parallel.LayoutError, match=r"LoRA adapters \(lora\)"):
        pipeline.refuse_unsupported(stage.model_copy(update={"lora": object()}), spec.resources, layout)
    pipeline.refuse_unsupported(stage.model_copy(update={"kind": "sft"}), spec.resources, layout)


def test_the_decoder_splits_by_blocks_under_the_whole_models_names():
    from runyard.model.decoder import DECODER
    from runyard.model.registry import NoPipelinePlan

    spec = spec_with({})
    cfg = DECODER.config_from_spec(resolved_stage(spec, "main").model, vocab_size=64)
    model = DECODER.build(cfg)
    first, last = DECODER.pipeline_stage(model, 0, 2), DECODER.pipeline_stage(model, 1, 2)
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(model.state_dict()) and not set(first.state_dict()) & set(last.state_dict())
    assert "tok_emb.weight" in first.state_dict() and "lm_head.weight" in last.state_dict()
    assert {"blocks.0.attn.wqkv.weight", "blocks.1.attn.wqkv.weight"} <= set(first.state_dict())
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        assert torch.equal(last(first(x)), model(x))  # the stages compose to the model
    with pytest.raises(NoPipelinePlan, match="model.n_layers"):
        DECODER.pipeline_stage(model, 0, 5)
    tied = DECODER.build(dataclasses.replace(cfg, tie_embeddings=True))
    with pytest.raises(NoPipelinePlan, match="model.tie_embeddings"):
        DECODER.pipeline_stage(tied, 0, 2)
