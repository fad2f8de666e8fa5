"""GPU check: runyard's own training loop on one GPU for the GPT-2-124M shape in bf16 with torch.compile:
tokens/s and MFU, against nanoGPT's train.py settings on the same GPU in the same run, and activation
checkpointing's memory and speed cost.

- runyard: `runyard.train.loop.train_stage`, the stage loop a run calls (its loader over a token store, the
  layout with compile per block, bf16 autocast, gradient accumulation, the loss normalised on the device,
  clipping, the non-finite guard, AdamW, readbacks only at the log interval, its final held-out evaluation
  and checkpoint). Its tokens/s is the loop's own steady-state figure (the first fifth of the steps, compile
  included, left out), the same one `runyard run` logs.
- nanoGPT peer: nanoGPT's train.py loop and settings (batch 12 x block 1024, fused AdamW lr 6e-4, betas
  0.9/0.95, weight decay 0.1 on matrices, clip 1.0, bf16 autocast, TF32, the whole model compiled, the next
  batch fetched from a uint16 memmap during the forward, `.item()` only at the log interval) on a
  nanoGPT-style model of runyard's shape (benchmarks/nanogpt_peer.py: same fused projections, SwiGLU,
  RMSNorm, rotary), so the figure compares the loops, not two architectures. Its tokens/s: the same
  steady-state rule over the same log intervals.
- activation checkpointing: runyard's loop again with `train.activation_checkpointing: full`: its step time
  over the loop's without it (target <= 1.4x), and its activation memory over the loop's without it
  (target <= 0.5x): the peak allocated bytes less the 16 bytes per parameter that weights, gradients and
  AdamW's two moments hold in fp32.

Shape: 12 layers, 768 wide, 12 heads, context 1024, vocabulary 50304 (GPT-2's, padded to a multiple of 64),
tied embeddings, SwiGLU hidden 2048 (as many weights as GPT-2's 4x MLP): ~124M parameters. Random tokens
(nothing is downloaded); the figures are speeds and memory, not losses. The three contenders alternate in
rounds (order reversed every other round); a ratio is the median of per-round ratios.

MFU = model FLOPs per token (the family's sizing: 6N + attention, the same for both: same shape) x tokens/s
/ the device's dense bf16 peak (train/metrics.py's table; a device not in it gets no MFU, not a guess).

    python benchmarks/gpu_check.py                 # one CUDA GPU: < 6 minutes; writes results/gpu_check.json
    python benchmarks/gpu_check.py --dry-run-cpu   # the same code path on CPU, tiny shape, a few steps
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nanogpt_peer  # noqa: E402
from harness import Report, Samples, add_common_args  # noqa: E402
from token_split import write_random_split  # noqa: E402

from runyard.data.pipeline import PreparedData  # noqa: E402
from runyard.model.registry import get_family  # noqa: E402
from runyard.spec.job import parse_spec, resolved_stage  # noqa: E402
from runyard.train import parallel  # noqa: E402
from runyard.train.loop import train_stage  # noqa: E402
from runyard.train.metrics import device_peak_flops, mfu  # noqa: E402

GPT2 = {"vocab": 50304, "d_model": 768, "n_layers": 12, "n_heads": 12, "ffn_hidden": 2048, "context": 1024}
TINY = {"vocab": 512, "d_model": 64, "n_layers": 2, "n_heads": 4, "ffn_hidden": 128, "context": 64}
NANOGPT = {"lr": 6e-4, "betas": (0.9, 0.95), "weight_decay": 0.1, "grad_clip": 1.0}
STATE_BYTES_PER_PARAM = 16  # fp32 weight, gradient and AdamW's two moments
CONTENDERS = ("runyard", "runyard_ac_full", "nanogpt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="the same code path on CPU (tiny shape, fp32, no compile, a few steps); records nothing")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps per contender per round (default 40)")
    ap.add_argument("--batch", type=int, default=12, help="sequences per micro-batch (nanoGPT's 12)")
    ap.add_argument("--grad-accum", type=int, default=8,
                    help="micro-batches per step (default 8; nanoGPT's 40 on one GPU takes 5x as long)")
    ap.add_argument("--log-interval", type=int, default=5, help="steps between readbacks, both loops (default 5)")
    ap.add_argument("--no-compile", action="store_true", help="eager mode for every contender")
    ap.add_argument("--no-record", action="store_true", help="on a GPU: do not write results/gpu_check.json")
    add_common_args(ap, repeats=2)
    return ap.parse_args(argv)


def write_tokens(root: Path, vocab: int, tokens: int, seed: int) -> tuple[Path, Path]:
    """A split of random tokens as runyard's token store (shards + index) and as nanoGPT's train.bin."""
    return write_random_split(root, f"split{seed}", vocab, tokens, seed, shard_tokens=1 << 22)


def spec_for(shape: dict, args: argparse.Namespace, ac: str, device: str, compile_model: bool):
    return parse_spec({
        "name": "gpu-check", "seed": 0, "data": {"sources": [{"path": "unused"}]},
        "model": {"d_model": shape["d_model"], "n_layers": shape["n_layers"], "n_heads": shape["n_heads"],
                  "n_kv_heads": shape["n_heads"], "ffn_hidden": shape["ffn_hidden"],
                  "context_length": shape["context"], "tie_embeddings": True, "dropout": 0.0},
        "optim": {"lr": NANOGPT["lr"], "betas": list(NANOGPT["betas"]), "weight_decay": NANOGPT["weight_decay"],
                  "grad_clip": NANOGPT["grad_clip"]},
        "schedule": {"warmup_steps": 5},
        "train": {"steps": args.steps, "batch_size": args.batch, "grad_accum": args.grad_accum,
                  "log_interval": args.log_interval, "activation_checkpointing": ac},
        "eval": {"interval": 10 * args.steps, "batches": 1},
        "checkpoint": {"interval": 10 * args.steps, "keep_last": 1, "keep_best": False},
        "resources": {"device": device, "precision": "bf16" if device == "cuda" else "fp32",
                      "compile": compile_model},
    })


def steady(per_step: list[float]) -> float:
    """The loop's own steady-state rule (train/loop.py): the mean after the first fifth of the steps."""
    kept = per_step[len(per_step) // 5:] or per_step
    return sum(kept) / len(kept)


class Runs:
    """Each contender's rounds: tokens/s, peak memory, wall time."""

    def __init__(self, device: torch.device):
        self.device = device
        self.tokens_per_s = {c: Samples() for c in CONTENDERS}
        self.peak_bytes = {c: Samples() for c in CONTENDERS}
        self.wall = {c: Samples() for c in CONTENDERS}

    @contextlib.contextmanager
    def measure(self, contender: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize(self.device)
            self.peak_bytes[contender].values.append(torch.cuda.max_memory_allocated(self.device))
        self.wall[contender].values.append(time.perf_counter() - t0)


def runyard_round(spec, prepared: PreparedData, workdir: Path, ctx: parallel.DistContext):
    stage = resolved_stage(spec, "main")
    stage_dir = workdir / "runs" / "stages" / "main"
    shutil.rmtree(workdir / "runs", ignore_errors=True)
    result = train_stage(spec, stage, prepared, stage_dir, ctx, show_progress=False)
    return result.tokens_per_s, result.losses[-1], result.config


def nanogpt_round(shape: dict, args: argparse.Namespace, train_bin: Path, device: torch.device,
                  compile_model: bool) -> tuple[float, float]:
    """nanoGPT's train.py loop, its settings, on the peer model of the same shape. (tokens/s, last loss)"""
    torch.manual_seed(1337)
    cfg = get_family("decoder").config_from_spec(
        resolved_stage(spec_for(shape, args, "none", device.type, compile_model), "main").model,
        vocab_size=shape["vocab"])
    model = nanogpt_peer.from_config(cfg).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": NANOGPT["weight_decay"]},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(groups, lr=NANOGPT["lr"], betas=NANOGPT["betas"], fused=cuda)
    forward = torch.compile(model) if compile_model else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    data = np.memmap(train_bin, dtype=np.uint16, mode="r")
    block, batch = shape["context"], args.batch

    def get_batch():
        ix = torch.randint(len(data) - block, (batch,))
        x = torch.stack([torch.from_numpy(data[i:i + block].astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block].astype(np.int64)) for i in ix])
        if cuda:
            return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
        return x, y

    x, y = get_batch()
    per_step: list[float] = []
    t0 = time.perf_counter()
    lossf = math.nan
    for it in range(args.steps):
        for group in optimizer.param_groups:  # nanoGPT's warmup, as runyard's loop sets its lr each step
            group["lr"] = NANOGPT["lr"] * min(1.0, (it + 1) / 5)
        for _ in range(args.grad_accum):
            with autocast:
                logits = forward(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1)) / args.grad_accum
            x, y = get_batch()  # fetched while the GPU works, as nanoGPT does
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), NANOGPT["grad_clip"])
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if (it + 1) % args.log_interval == 0 or it + 1 == args.steps:
            lossf = loss.item() * args.grad_accum  # the readback that waits for the device
            t1 = time.perf_counter()
            steps_here = (it + 1) - len(per_step)
            per_step += [steps_here * args.grad_accum * batch * block / (t1 - t0)] * steps_here
            t0 = t1
    return steady(per_step), lossf


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run_cpu:
        device, shape, compile_model = torch.device("cpu"), TINY, False
        args.batch, args.grad_accum, args.steps, args.log_interval = 2, 1, 5, 1
        args.repeats = min(args.repeats, 1)
        if args.record:
            print("gpu_check: --dry-run-cpu checks the code path; its figures are not recorded")
        args.record = False
    else:
        if not torch.cuda.is_available():
            print("gpu_check: needs a CUDA GPU, and torch sees none (torch.cuda.is_available() is False). "
                  "Run it on a GPU machine, or `--dry-run-cpu` to check the code path on CPU.", file=sys.stderr)
            return 2
        device, shape, compile_model = torch.device("cuda"), GPT2, not args.no_compile
        args.record = not args.no_record
        torch.backends.cuda.matmul.allow_tf32 = True  # nanoGPT's setting, for both
        torch.backends.cudnn.allow_tf32 = True
    started = time.perf_counter()
    report = Report("gpu_check", args)
    ctx = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=device)
    runs = Runs(device)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        workdir = Path(tmp)
        tokens_needed = args.steps * args.grad_accum * args.batch * (shape["context"] + 1)
        train_index, train_bin = write_tokens(workdir, shape["vocab"], max(2 * tokens_needed, 1 << 16), seed=0)
        heldout_index, _ = write_tokens(workdir, shape["vocab"], 4 * args.batch * (shape["context"] + 1), seed=1)
        prepared = PreparedData(tokenizer_path=workdir / "unused.json", vocab_size=shape["vocab"], eos_id=0,
                                train_index=train_index, heldout_index=heldout_index, fingerprint="gpu-check",
                                stats={}, input_fingerprints={})
        specs = {"runyard": spec_for(shape, args, "none", device.type, compile_model),
                 "runyard_ac_full": spec_for(shape, args, "full", device.type, compile_model)}
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"device: {name}; shape {shape}; batch {args.batch} x grad_accum {args.grad_accum}; {args.steps} "
              f"steps per round; compile {compile_model}; bf16 {device.type == 'cuda'}", flush=True)
        config, losses = None, {}
        for r in range(args.repeats):
            for contender in CONTENDERS if r % 2 == 0 else CONTENDERS[::-1]:
                with runs.measure(contender):
                    if contender == "nanogpt":
                        tok_s, losses[contender] = nanogpt_round(shape, args, train_bin, device, compile_model)
                    else:
                        tok_s, losses[contender], config = runyard_round(specs[contender], prepared, workdir, ctx)
                runs.tokens_per_s[contender].values.append(tok_s)
                print(f"  round {r + 1}/{args.repeats} {contender}: {tok_s:,.0f} tokens/s, last loss "
                      f"{losses[contender]:.3f}, {runs.wall[contender].values[-1]:.1f} s", file=sys.stderr, flush=True)
    sizing = get_family("decoder").sizing(config)
    flops_per_token, peak = sizing.flops_per_unit, device_peak_flops(device)
    params = sum(p.numel() for p in get_family("decoder").build(config).parameters())
    figures = {}
    for contender in CONTENDERS:
        tok_s = runs.tokens_per_s[contender]
        util = mfu(flops_per_token, tok_s.median, peak)
        figures[contender] = {"tokens_per_s": tok_s.median, "mfu": util, "peak_bytes": runs.peak_bytes[contender].values,
                              "wall_s": runs.wall[contender].values}
        shown = "n/a (no dense bf16 peak known for this device)" if util is None else f"{util * 100:.1f}%"
        memory = (f", peak {runs.peak_bytes[contender].median / 2**30:.2f} GiB" if runs.peak_bytes[contender].values
                  else "")
        print(f"{contender:<16} tokens/s {tok_s.spread()}, MFU {shown}{memory}")
    print(f"model: {params / 1e6:.1f}M parameters, {flops_per_token / 1e6:.1f} MFLOP per token")

    def per_round(a: str, b: str) -> Samples:
        return Samples([x / y for x, y in zip(runs.tokens_per_s[a].values, runs.tokens_per_s[b].values, strict=True)])

    # Same shape, so the same FLOPs per token: the MFU ratio is the tokens/s ratio, peak or no peak.
    report.ratio("gpu_runyard_loop_vs_nanogpt", per_round("runyard", "nanogpt"),
                 f"nanoGPT's train.py loop and settings on a model of the same shape, same {name}"
                 f"{', bf16, compiled' if compile_model else ''}", ">=", 1.0,
                 {"device": name, "peak_flops": peak, "flops_per_token": flops_per_token, "parameters": params,
                  "batch": args.batch, "grad_accum": args.grad_accum, "steps": args.steps, "contenders": figures})
    report.ratio("gpu_activation_checkpointing_full_step_time", per_round("runyard", "runyard_ac_full"),
                 f"runyard's loop without activation checkpointing, same {name}", "<=", 1.4)
    if device.type == "cuda":
        state = STATE_BYTES_PER_PARAM * params
        activations = {c: Samples([b - state for b in runs.peak_bytes[c].values]) for c in ("runyard", "runyard_ac_full")}
        report.ratio("gpu_activation_checkpointing_full_activation_memory",
                     Samples([a / b for a, b in zip(activations["runyard_ac_full"].values, activations["runyard"].values,
                                                    strict=True)]),
                     "runyard's loop without it: peak allocated less 16 bytes per parameter", "<=", 0.5,
                     {"state_bytes": state, "peak_bytes": {c: runs.peak_bytes[c].values for c in runs.peak_bytes}})
    else:
        report.note("activation memory is measured on CUDA only (the allocator's peak); not on this CPU dry run")
    report.note(f"whole check: {time.perf_counter() - started:.0f} s")
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
