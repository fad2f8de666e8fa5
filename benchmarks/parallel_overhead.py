"""What a parallel layout costs where it is not needed, and what activation checkpointing costs and saves.

Layouts (2 processes under torchrun, gloo, CPU): runyard's decoder laid out by the loop's own
`train/layout.py` as `resources.parallel` asks (`fsdp`: FSDP2 over the family's blocks; `{tp: 2}`: each block
split by the family's tensor-parallel plan; `pp` where this runyard has it), each training on the same global
batch of tokens with the loop's step (forward, loss normalised by the global token count, backward, clip
over the layout's gradients, AdamW). Every layout's model lives in the same two processes and the layouts
alternate round by round (harness.interleaved, run on every rank in the same order). Figure: tokens/s of the
layout over DDP's on the same processes, model and global batch. A layout the model fits without it only
pays its communication here; the floors (FSDP >= 0.5x, TP >= 0.25x of DDP) are runyard's own, to flag a
layout that regresses, not a speed-up anyone should expect on CPU.

Activation checkpointing (one process): the same step with `train.activation_checkpointing: full` and
`selective` (every other block) over the step without it: step time, and the bytes kept for backward by one
forward (saved-tensor hooks; benchmarks/activation_checkpointing.py measures the same way). The issue's
targets: full at most 1.4x the step time at most 0.5x the activation memory; selective at most 1.4x the
time, and less memory than none.

Run: python benchmarks/parallel_overhead.py [--record] [--repeats N] [--tiny]   (default: ~2-3 minutes)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from activation_checkpointing import saved_bytes  # noqa: E402
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.model.compute import token_loss_sum  # noqa: E402
from runyard.model.registry import get_family  # noqa: E402
from runyard.model.transformer import ModelConfig  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.spec.sections import ParallelSpec  # noqa: E402
from runyard.train import layout, parallel  # noqa: E402

FAMILY = get_family("decoder")
SHAPES = {
    "default": (ModelConfig(vocab_size=2048, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=384,
                            context_length=128), 8),
    "tiny": (ModelConfig(vocab_size=256, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64,
                         context_length=32), 4),
}
LAYOUTS = {"ddp": "ddp", "fsdp": "fsdp", "tp": {"tp": 2}}
FLOORS = {"fsdp": 0.5, "tp": 0.25, "pp": 0.25}
PEER = "DDP on the same 2 processes, model and global batch (CPU, gloo)"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, repeats=5)
    p.add_argument("--steps", type=int, default=3, help="training steps per timed call (default 3)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and batch: checks the script in seconds")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # a torchrun rank; rank 0 writes JSON here
    return p.parse_args(argv)


def stage_of(setting, cfg: ModelConfig, ac: str = "none"):
    spec = parse_spec({"name": "overhead", "data": {"sources": [{"path": "unused"}]},
                       "model": {"d_model": cfg.d_model, "n_layers": cfg.n_layers, "n_heads": cfg.n_heads,
                                 "n_kv_heads": cfg.n_kv_heads, "context_length": cfg.context_length},
                       "train": {"activation_checkpointing": ac},
                       "resources": {"device": "cpu", "parallel": setting}})
    return spec, resolved_stage(spec, "main")


class LaidOut:
    """One layout's model, optimizer and the loop's step on this process's share of a global batch."""

    def __init__(self, setting, cfg: ModelConfig, ctx: parallel.DistContext, tokens: torch.Tensor, ac: str = "none"):
        spec, stage = stage_of(setting, cfg, ac)
        self.ctx = parallel.with_layout(ctx, spec.resources)
        torch.manual_seed(0)
        self.model = FAMILY.build(cfg)
        self.module = layout.lay_out(self.model, FAMILY, self.ctx, spec.resources, stage.train)
        self.optimizer = torch.optim.AdamW(FAMILY.optimizer_groups(self.model, stage.optim), lr=1e-3)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        data = self.ctx.data  # under tp both ranks read the same rows; under ddp/fsdp each its half
        self.tokens = tokens.chunk(data.world_size)[data.rank]
        self.scale = data.world_size / tokens[:, 1:].numel()

    def step(self) -> None:
        x, y = self.tokens[:, :-1], self.tokens[:, 1:]
        loss = token_loss_sum(self.module(x), y) * self.scale
        loss.backward()
        parallel.clip_grad_norm(self.params, 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def layouts_here() -> tuple[dict, str | None]:
    """The layouts to time, and why pipeline parallel is left out (None when it is timed)."""
    chosen = dict(LAYOUTS)
    if "pp" not in ParallelSpec.model_fields:
        return chosen, "pipeline parallel: resources.parallel has no `pp` in this runyard; not timed"
    chosen["pp"] = {"pp": 2}
    return chosen, None


def worker(args: argparse.Namespace) -> int:
    torch.set_num_threads(1)
    ctx = parallel.setup("cpu")
    cfg, batch = SHAPES["tiny" if args.tiny else "default"]
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1), generator=torch.Generator().manual_seed(1))
    chosen, _ = layouts_here()
    runs, skipped = {}, {}
    for name, setting in chosen.items():
        try:
            runs[name] = LaidOut(setting, cfg, ctx, tokens)
            runs[name].step()  # a layout whose step this loop cannot take is found before timing
        except Exception as exc:  # a layout this runyard or this model cannot take is reported, not fatal
            skipped[name] = f"{type(exc).__name__}: {exc}"

    def timed(run: LaidOut):
        def call() -> None:
            for _ in range(args.steps):
                run.step()
            dist.barrier()  # a call ends when every rank's steps have
        return call

    times = interleaved({name: timed(run) for name, run in runs.items()}, args.repeats, progress=ctx.is_main)
    if ctx.is_main:
        args.worker.write_text(json.dumps({"seconds": {n: s.values for n, s in times.items()}, "skipped": skipped,
                                           "tokens_per_call": args.steps * tokens[:, 1:].numel()}))
    dist.destroy_process_group()
    return 0


def time_layouts(args: argparse.Namespace, report: Report) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "layouts.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
                "--worker", str(out), "--repeats", str(args.repeats), "--steps", str(args.steps)]
        subprocess.run(argv + (["--tiny"] if args.tiny else []), check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        result = json.loads(out.read_text())
    seconds = {name: Samples(values) for name, values in result["seconds"].items()}
    tokens = result["tokens_per_call"]
    for name, why in result["skipped"].items():
        report.note(f"layout {name} not timed: {why}")
    for name, s in seconds.items():
        print(f"{name:<5} tokens/s {s.rate(tokens).spread()}")
    for name in seconds:
        if name == "ddp":
            continue
        # tokens/s ratio = DDP's time over the layout's, round by round
        report.ratio(f"parallel_{name}_tokens_per_s_vs_ddp", paired_ratio(seconds["ddp"], seconds[name]), PEER, ">=",
                     FLOORS.get(name, 0.25), {"tokens_per_call": tokens, "seconds": result["seconds"]})


def time_activation_checkpointing(args: argparse.Namespace, report: Report) -> None:
    cfg, batch = SHAPES["tiny" if args.tiny else "default"]
    ctx = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context_length + 1), generator=torch.Generator().manual_seed(1))
    runs = {mode: LaidOut("ddp", cfg, ctx, tokens, ac=mode) for mode in ("none", "full", "selective")}

    def timed(run: LaidOut):
        def call() -> None:
            for _ in range(args.steps):
                run.step()
        return call

    times = interleaved({mode: timed(run) for mode, run in runs.items()}, args.repeats)
    kept = {mode: saved_bytes(run.model, run.module, tokens) for mode, run in runs.items()}
    report.note(f"bytes kept for backward by one forward: none {kept['none']}, full {kept['full']}, "
                f"selective {kept['selective']}")
    for mode, memory_target in (("full", 0.5), ("selective", 0.999)):
        report.ratio(f"activation_checkpointing_{mode}_step_time", paired_ratio(times[mode], times["none"]),
                     "the same step without activation checkpointing", "<=", 1.4,
                     {"none_s": times["none"].median, f"{mode}_s": times[mode].median})
        report.ratio(f"activation_checkpointing_{mode}_saved_bytes", Samples([kept[mode] / kept["none"]]),
                     "bytes kept for backward without activation checkpointing", "<=", memory_target,
                     {"none_bytes": kept["none"], f"{mode}_bytes": kept[mode]})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    if args.tiny and args.record:
        print("parallel_overhead: --tiny checks the script; its figures are not recorded")
        args.record = False
    torch.set_num_threads(1)
    report = Report("parallel_overhead", args)
    report.note(f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    _, no_pp = layouts_here()
    if no_pp:
        report.note(no_pp)
    print("== layouts on 2 processes (torchrun, gloo) ==", flush=True)
    time_layouts(args, report)
    print("== activation checkpointing (1 process) ==", flush=True)
    time_activation_checkpointing(args, report)
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
