"""Tensor parallel (resources.parallel: {tp: 2}) through the real command line: two torchrun workers on CPU
with gloo split every block by the decoder family's plan (Q/K/V and gate/up column-wise, the attention
output and down projection row-wise, through DTensor's parallelize_module).

- For 20 steps, per-step losses, gradient norms and held-out losses equal the one-process run's within fp32
  tolerance, and so do the gradients of step 1 (read from the step-1 checkpoints: AdamW's first moment
  after one step is (1 - beta1) x the clipped gradient, whole and by parameter name).
- The checkpoint holds the model's own tensors whatever the layout (fused rows in the model's order), so a
  run stopped under tp 2 resumes under one process and one stopped under one process resumes under tp 2,
  each ending where the uninterrupted run ends.
- The export is the same Hugging Face directory whatever the layout wrote it.
- dp_shard 2 x tp 2 on four processes (FSDP2 over the tensor-parallel groups, one 2-D device mesh) gives
  the one-process losses and step-1 gradients too (full tier).
- An sft stage (masks, records of uneven supervised counts) trains under tp 2 as it does in one process:
  every rank reads the same batch, so the masks and the global supervised count are the one process's;
  its losses, held-out response losses and step-1 gradients are the one-process run's. A dpo stage is
  refused by name."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from runyard.errors import EXIT_PREEMPTED
from runyard.model.hf.config import read_config
from runyard.model.registry import get_family
from runyard.spec.job import load_spec, resolved_stage
from runyard.train import checkpoint as ckpt
from runyard.train import parallel, tensor_parallel
from runyard.train.checkpoint import sharded

from .conftest import TINY_SPEC, merge, runyard, shared_once
from .test_distributed import start, wait_for_step
from .uneven_records import sft_stage_patch, write_uneven_records

pytestmark = pytest.mark.slow

STEPS = 20
SPEC = {
    "model": {"dropout": 0.0},
    "train": {"steps": STEPS, "batch_size": 4},
    "stages": [{"name": "main", "gates": {"min_loss_drop": None}}],
    "eval": {"interval": 5},
    # Every step checkpointed and kept: step 1's holds the first gradients, and a stop loses no step.
    "checkpoint": {"interval": 1, "keep_last": STEPS},
}
TP = {"resources": {"parallel": {"tp": 2}}}
LOSS_RTOL, GRAD_ATOL, WEIGHT_ATOL = 1e-5, 1e-6, 1e-4


def write(tmp: Path, name: str, patch: dict) -> Path:
    spec = tmp / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(merge(merge(TINY_SPEC, SPEC), patch)))
    return spec


def run(spec: Path, run_dir: Path, *extra: str) -> Path:
    runyard("run", str(spec), "--run-dir", str(run_dir), "--no-progress", *extra, check=True, timeout=400)
    return run_dir


def stop_with_sigterm(spec: Path, run_dir: Path, nproc: int, after_step: int = 3) -> int:
    proc = start("train", str(spec), "--run-dir", str(run_dir), "--nproc", str(nproc))
    wait_for_step(run_dir, after_step, proc)
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=120)
    assert proc.returncode == EXIT_PREEMPTED, err
    stopped = ckpt.list_checkpoints(run_dir / "stages/main/checkpoints")[-1].step
    assert after_step <= stopped < STEPS
    return stopped


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "stages/main/metrics.jsonl").read_text().splitlines()]


def assert_same_curve(a: Path, b: Path) -> None:
    ra, rb = rows(a), rows(b)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=LOSS_RTOL), x["step"]
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-4), x["step"]
        if "heldout_loss" in x:
            assert y["heldout_loss"] == pytest.approx(x["heldout_loss"], rel=LOSS_RTOL), x["step"]


def checkpoint_at(run_dir: Path, step: int) -> Path:
    return next(c.path for c in ckpt.list_checkpoints(run_dir / "stages/main/checkpoints") if c.step == step)


def assert_same_final_weights(a: Path, b: Path) -> None:
    wa, wb = (ckpt.read_model_weights(checkpoint_at(d, STEPS)) for d in (a, b))
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], rtol=0, atol=WEIGHT_ATOL), name


def assert_same_export(a: Path, b: Path) -> None:
    """The same Hugging Face directory: the same files, config and tokenizer byte for byte, the same
    tensors under the same names (values within fp32 tolerance: the layouts sum in different orders)."""
    ea, eb = a / "export", b / "export"
    files = sorted(p.name for p in ea.iterdir())
    assert files == sorted(p.name for p in eb.iterdir())
    for name in files:  # runyard.json names the spec's hash, and the specs differ by their layout
        if name == "config.json" or name.startswith(("tokenizer", "special_tokens", "generation", "chat_template")):
            assert (ea / name).read_bytes() == (eb / name).read_bytes(), name
    ta, tb = load_file(ea / "model.safetensors"), load_file(eb / "model.safetensors")
    assert ta.keys() == tb.keys()
    for name in ta:
        assert ta[name].shape == tb[name].shape and ta[name].dtype == tb[name].dtype, name
        assert torch.allclose(ta[name], tb[name], rtol=0, atol=WEIGHT_ATOL), name


def first_moments(run_dir: Path, spec: Path) -> dict[str, torch.Tensor]:
    """AdamW's exp_avg after step 1, by parameter name, whichever format the step-1 checkpoint has."""
    path = checkpoint_at(run_dir, 1)
    if ckpt.is_sharded(path):
        return {name: s["exp_avg"] for name, s in sharded.read_optimizer_state(path).items()}
    # One process: the state is numbered in the optimizer's group order, which the family's groups give.
    family = get_family("decoder")
    model = family.build(read_config(run_dir / "export"))
    names = {id(p): n for n, p in model.named_parameters()}
    groups = family.optimizer_groups(model, resolved_stage(load_spec(spec), "main").optim)
    order = [names[id(p)] for g in groups for p in g["params"]]
    state = ckpt.read_checkpoint(path)[0]["optimizer"]["state"]
    return {order[int(i)]: s["exp_avg"] for i, s in state.items()}


@pytest.fixture(scope="session")
def one_process(tmp_path_factory) -> tuple[Path, Path]:
    """The uninterrupted one-process run (spec, run directory) every test compares with: made once per
    session, whichever xdist worker asks first (shared_once); read only."""
    root = shared_once(tmp_path_factory, "tp-one", lambda tmp: run(write(tmp, "one", {}), tmp / "one"))
    return root / "one.yaml", root / "one"


def test_two_tensor_parallel_processes_match_one_process(one_process, tmp_path):
    spec_one, one = one_process
    # with every block recomputed in backward too: recomputed tensor-parallel blocks give the same curve
    tp = run(write(tmp_path, "tp", merge(TP, {"train": {"activation_checkpointing": "full"}})), tmp_path / "tp",
             "--nproc", "2")
    assert_same_curve(one, tp)
    gates = json.loads((tp / "stages/main/gates.json").read_text())
    assert gates["passed"], gates
    # The gradients of step 1, consolidated (whole tensors in the model's order) by parameter name.
    ga, gb = first_moments(one, spec_one), first_moments(tp, tmp_path / "tp.yaml")
    assert ga.keys() == gb.keys() and len(ga) > 4
    for name in ga:
        assert ga[name].abs().sum() > 0, name
        assert torch.allclose(ga[name], gb[name], rtol=1e-4, atol=GRAD_ATOL), name
    assert_same_final_weights(one, tp)
    assert_same_export(one, tp)


@pytest.mark.full  # fast tier: the other direction (one process -> TP)
def test_a_run_stopped_under_tensor_parallel_resumes_in_one_process(one_process, tmp_path):
    """tp 2 -> 1: the checkpoint written by two ranks' shards loads into one whole model and optimizer."""
    _spec_one, one = one_process
    run_dir = tmp_path / "run"
    stop_with_sigterm(write(tmp_path, "tp", TP), run_dir, 2)
    run(write(tmp_path, "one", {}), run_dir)  # the layout edited in the spec: the run continues
    events = json.loads((run_dir / "recovery.json").read_text())["events"]
    assert [e["world_size"] for e in events] == [1]
    assert_same_curve(one, run_dir)
    assert_same_final_weights(one, run_dir)
    assert_same_export(one, run_dir)


def test_a_one_process_run_resumes_under_tensor_parallel(one_process, tmp_path):
    """1 -> tp 2: the one-process checkpoint's whole tensors are split by rows, fused ones rank by rank."""
    _spec_one, one = one_process
    run_dir = tmp_path / "run"
    stop_with_sigterm(write(tmp_path, "one", {}), run_dir, 1)
    run(write(tmp_path, "tp", TP), run_dir, "--nproc", "2")
    events = json.loads((run_dir / "recovery.json").read_text())["events"]
    assert [e["world_size"] for e in events] == [2]
    assert_same_curve(one, run_dir)
    assert_same_final_weights(one, run_dir)
    assert_same_export(one, run_dir)


@pytest.mark.full  # four processes: the fast tier keeps tp 2 alone (above)
def test_fsdp_over_tensor_parallel_groups_on_four_processes_matches_one_process(tmp_path):
    """dp_shard 2 x tp 2 on one 2-D device mesh: each pair of consecutive ranks splits the blocks (DTensor),
    FSDP2 shards each rank's split blocks over the other pair, and the two pairs read two halves of the
    global batch (8 sequences; one process: 4 x 2 accumulated). The losses and held-out losses of 20 steps
    are one process's within fp32 rounding; so are the step-1 gradients, read whole from the checkpoint; the
    gates pass and the export is the run's own weights gathered from the 2-D shards to rank 0."""
    spec_one = write(tmp_path, "one", {"train": {"grad_accum": 2}})
    spec_four = write(tmp_path, "four", {"resources": {"parallel": {"dp_shard": 2, "tp": 2}}})
    one, four = run(spec_one, tmp_path / "one"), run(spec_four, tmp_path / "four", "--nproc", "4")
    ra, rb = rows(one), rows(four)
    assert [r["step"] for r in ra] == [r["step"] for r in rb] == list(range(1, STEPS + 1))
    for x, y in zip(ra, rb, strict=True):
        assert y["loss"] == pytest.approx(x["loss"], rel=LOSS_RTOL), x["step"]
        assert y["tokens"] == x["tokens"], x["step"]
        # a gradient's norm near a plateau magnifies the layouts' different orders of summation more than
        # the loss does (step 1's agree to 1e-7)
        assert y["grad_norm"] == pytest.approx(x["grad_norm"], rel=1e-3), x["step"]
        if "heldout_loss" in x:
            assert y["heldout_loss"] == pytest.approx(x["heldout_loss"], rel=LOSS_RTOL), x["step"]
    assert rb[0]["grad_norm"] == pytest.approx(ra[0]["grad_norm"], rel=1e-6)
    ga, gb = first_moments(one, spec_one), first_moments(four, spec_four)
    assert ga.keys() == gb.keys() and len(ga) > 4
    for name in ga:
        assert ga[name].abs().sum() > 0, name
        assert torch.allclose(ga[name], gb[name], rtol=1e-4, atol=GRAD_ATOL), name
    assert json.loads((four / "stages/main/gates.json").read_text())["passed"]
    # The export is the 2-D shards gathered whole in the model's order: its tensors are the run's own final
    # checkpoint's (the fused Q/K/V rows split back by part; V and gate/up are not permuted for rotary).
    # (The final weights are not compared with one process's: over 20 AdamW steps an element whose gradient
    # is rounding noise moves by up to the learning rate either way, whatever the layout.)
    exported, trained = load_file(four / "export/model.safetensors"), ckpt.read_model_weights(checkpoint_at(four, STEPS))
    assert torch.equal(exported["model.embed_tokens.weight"], trained["tok_emb.weight"])
    assert torch.equal(exported["model.layers.1.self_attn.v_proj.weight"], trained["blocks.1.attn.wqkv.weight"][48:])
    assert torch.equal(exported["model.layers.0.mlp.up_proj.weight"], trained["blocks.0.ffn.w_gate_up.weight"][96:])
    assert torch.equal(exported["model.layers.0.self_attn.o_proj.weight"], trained["blocks.0.attn.wo.weight"])


@pytest.mark.full  # fast tier: sft masks across processes (test_finetune_run, DDP); tp 2 trains (above)
def test_an_sft_stage_under_tensor_parallel_matches_one_process(tmp_path):
    """Masks under tp 2: the same losses, held-out response losses, padding and step-1 gradients as one process."""
    sft = sft_stage_patch(write_uneven_records(tmp_path / "records.jsonl"))
    spec_one, spec_tp = write(tmp_path, "one", sft), write(tmp_path, "tp", merge(sft, TP))
    one, tp = run(spec_one, tmp_path / "one"), run(spec_tp, tmp_path / "tp", "--nproc", "2")
    assert_same_curve(one, tp)
    ra, rb = rows(one), rows(tp)
    # the batches' rows differ in length (their padding is real) and are the same batches under both layouts
    assert all(0 < r["padding_fraction"] < 1 for r in ra)
    assert [r["padding_fraction"] for r in ra] == pytest.approx([r["padding_fraction"] for r in rb], rel=1e-12)
    assert [r["tokens"] for r in ra] == [r["tokens"] for r in rb]
    assert any(r["heldout_response_tokens"] > 0 for r in ra if "heldout_response_tokens" in r)
    ga, gb = first_moments(one, spec_one), first_moments(tp, spec_tp)
    assert ga.keys() == gb.keys() and len(ga) > 4
    for name in ga:
        assert ga[name].abs().sum() > 0, name
        assert torch.allclose(ga[name], gb[name], rtol=1e-4, atol=GRAD_ATOL), name
    # the before/after record: the initial and final weights gathered whole to rank 0, evaluated there
    fa, fb = (json.loads((d / "stages/main/finetune.json").read_text()) for d in (one, tp))
    for when in ("before", "after"):
        assert fb[when]["metrics"]["heldout_loss"] == pytest.approx(fa[when]["metrics"]["heldout_loss"], rel=LOSS_RTOL)
    assert fb["parameters"] == fa["parameters"]  # counted on the whole model, not a rank's shards
    assert_same_export(one, tp)


def test_a_dpo_stage_and_sft_inside_fsdp_are_refused_under_tensor_parallel_by_name(tmp_path):
    sft = sft_stage_patch(tmp_path / "records.jsonl")
    spec = load_spec(write(tmp_path, "dpo", merge(merge(sft, TP), {"stages": [merge(sft["stages"][0], {"kind": "dpo"})]})))
    layout = parallel.layout_of(spec.resources.parallel, 2)
    with pytest.raises(parallel.LayoutError, match=r"tensor parallel \(resources.parallel.tp 2\) trains pretrain and "
                                                    r"sft stages, not dpo"):
        tensor_parallel.refuse_unsupported(resolved_stage(spec, "main"), layout)
    tensor_parallel.refuse_unsupported(resolved_stage(load_spec(write(tmp_path, "sft", merge(sft, TP))), "main"), layout)
    # inside FSDP (dp_shard x tp) an sft stage is refused too: its supervised count would be summed over
    # every rank rather than over the data ranks
    two_d = {"resources": {"parallel": {"dp_shard": 2, "tp": 2}}}
    spec = load_spec(write(tmp_path, "sft2d", merge(sft, two_d)))
    with pytest.raises(parallel.LayoutError, match=r"dp_shard 2 x tp 2\) trains pretrain stages only, not sft"):
        tensor_parallel.refuse_unsupported(resolved_stage(spec, "main"), parallel.layout_of(spec.resources.parallel, 4))
