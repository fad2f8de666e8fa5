"""Checkpoint I/O: runyard's saves and loads against the raw cost of the same bytes, same run.

A GPT-2-small-like model (768 wide, 12 layers, 32k vocabulary, untied head: 162M parameters) after one
AdamW step, so the optimizer holds both moments: 1.82 GiB of state.

One process (the path a one-process training run takes: `checkpoint.save`, i.e. the plain format of
safetensors-layout files, written synchronously, checksummed while written, committed atomically):
  - save against the peer, a raw write of the same tensors' memory to one file, no copy
    (`write(memoryview)` on an unbuffered file), one fsync. Target >= 0.8x.
  - load into model and optimizer (read straight into the live tensors, every file checked against its
    manifest checksum while read) against a raw sequential read of the same bytes into the same live
    tensors (raw write's mirror). Target >= 0.8x. A raw read into one buffer of the whole size is a note
    beside it: faster than any load can be, since the state lives in hundreds of tensors.
World size 2 under torchrun (the path a multi-process run takes: DDP, every rank writing its part through
torch.distributed.checkpoint, rank 0 committing):
  - the synchronous sharded save against both ranks writing half the bytes each, raw, concurrently,
    between the same barriers. Target >= 0.8x.
  - how long an async sharded save stalls the training loop, against the synchronous save. Target <= 0.1x.
    The stall is the save call plus the wait at the next optimizer step, after that step's forward and
    backward (`--step-tokens` a rank): parameters and optimizer state are written from the live tensors, and
    what is not written by then is copied there (train/checkpoint/deferred_copies.py). The step itself,
    slowed by the write behind it, is a note beside the step without a save.
  - the sharded load into every rank's model and optimizer (under DDP each rank holds the whole state, so
    reads all of it) against each rank raw-reading the same bytes from one file into its live tensors,
    concurrently. Target >= 0.8x.

All contenders alternate in interleaved rounds; each figure is the median over `--repeats` with its
spread. The page cache is not dropped (that needs root); the raw peers see the same conditions.

    python benchmarks/checkpoint_io.py [--repeats 3] [--record] [--d-model 768 --layers 12 --vocab 32000]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import Report, Samples, add_common_args, interleaved, paired_ratio  # noqa: E402

from runyard.model.compute import forward_backward  # noqa: E402
from runyard.model.transformer import ModelConfig, Transformer  # noqa: E402
from runyard.train import checkpoint as ckpt  # noqa: E402
from runyard.train import parallel  # noqa: E402
from runyard.train.loop import TrainSetup  # noqa: E402


class _Position:
    """The loader's only part a checkpoint reads; a benchmark has no data."""

    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="where checkpoints are written")
    ap.add_argument("--skip-sharded", action="store_true", help="only the one-process figures")
    ap.add_argument("--step-tokens", type=int, default=64,
                    help="tokens a rank trains on in the step after an async save (its forward and backward "
                         "overlap the write; default 64)")
    ap.add_argument("--sharded-worker", type=Path, help=argparse.SUPPRESS)  # a torchrun rank; JSON out here
    add_common_args(ap, repeats=3)
    return ap.parse_args(argv)


def build(args, ctx: parallel.DistContext) -> TrainSetup:
    torch.manual_seed(0)
    heads = max(1, args.d_model // 64)
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=heads,
                      n_kv_heads=heads, ffn_hidden=4 * args.d_model, context_length=1024, tie_embeddings=False)
    model = Transformer(cfg)
    module = parallel.wrap_model(model, ctx, argparse.Namespace(parallel="ddp", precision="fp32"))
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4)
    for p in model.parameters():  # one real step so the optimizer holds its two moments per parameter
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return TrainSetup(model, module, cfg, opt, _Position())


def state_tensors(setup: TrainSetup) -> list[torch.Tensor]:
    tensors = list(setup.model.state_dict().values())
    for s in setup.optimizer.state.values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    """The peer: each tensor's own memory handed to write(2), no intermediate copy, one fsync."""
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            f.write(memoryview(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        os.fsync(f.fileno())


def raw_read(path: Path, tensors: list[torch.Tensor]) -> None:
    """The peer: the file `raw_write` wrote read straight back into the tensors' own memory (the live model
    and optimizer state, which is where a load must put the bytes), in 8 MiB reads, nothing parsed or
    checked: raw_write's mirror."""
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            _read_exactly(f, memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()))


def raw_read_one_buffer(path: Path, dest: torch.Tensor) -> None:
    """A note beside the peer: the same bytes read into one allocation (the raw peer of stops before 47).
    It is faster than any loader can be: the state lives in hundreds of tensors, and reads into one
    buffer would need a copy into them."""
    with open(path, "rb", buffering=0) as f:
        _read_exactly(f, memoryview(dest.numpy()))


def _read_exactly(f, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = f.readinto(view[got : got + (8 << 20)])
        if not n:
            raise EOFError(f"{f.name} ends before the tensors it was written from")
        got += n


def halves(tensors: list[torch.Tensor], parts: int) -> list[list[torch.Tensor]]:
    """Tensors dealt to `parts` writers, largest first to the least loaded: an even split of the bytes."""
    out: list[list[torch.Tensor]] = [[] for _ in range(parts)]
    load = [0] * parts
    for t in sorted(tensors, key=lambda t: -t.numel() * t.element_size()):
        i = load.index(min(load))
        out[i].append(t)
        load[i] += t.numel() * t.element_size()
    return out


def one_process(args, report: Report) -> None:
    ctx = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    setup = build(args, ctx)
    tensors = state_tensors(setup)
    gib = nbytes(tensors) / 2**30
    print(f"model: {setup.model.num_parameters() / 1e6:.1f}M parameters; model + AdamW state: {gib:.2f} GiB")
    root = Path(tempfile.mkdtemp(prefix="runyard-ckpt-bench-", dir=args.dir))
    raw_file, ckpt_dir = root / "raw.bin", root / "ckpt"
    try:
        def clear(_name: str) -> None:
            raw_file.unlink(missing_ok=True)
            shutil.rmtree(ckpt_dir, ignore_errors=True)

        print("== one process: save (checkpoint.save -> plain format) ==")
        saves = interleaved({
            "raw write": lambda: raw_write(raw_file, tensors),
            "runyard save": lambda: ckpt.save(setup.state, ckpt_dir, 1, {}, ctx, wait=True),
        }, args.repeats, before=clear)
        show(saves, gib)
        report.ratio("checkpoint_save_1proc", paired_ratio(saves["raw write"], saves["runyard save"]),
                     "raw write of the tensors' memory + fsync", ">=", 0.8,
                     {"gib": gib, "raw_s": saves["raw write"].values, "runyard_s": saves["runyard save"].values})

        print("== one process: load into model + optimizer ==")
        clear("")
        raw_write(raw_file, tensors)
        ckpt.save(setup.state, ckpt_dir, 1, {}, ctx, wait=True)
        ref = ckpt.latest_good(ckpt_dir)
        dest = torch.zeros(raw_file.stat().st_size, dtype=torch.uint8)  # touched once, as live tensors are
        loads = interleaved({
            "raw read": lambda: raw_read(raw_file, tensors),
            "runyard load": lambda: ckpt.load_from(setup.state, ref.path, ctx),
            "raw read, one buffer": lambda: raw_read_one_buffer(raw_file, dest),
        }, args.repeats)
        show(loads, gib)
        report.ratio("checkpoint_load_1proc", paired_ratio(loads["raw read"], loads["runyard load"]),
                     "raw sequential read of the same bytes into the live tensors", ">=", 0.8,
                     {"gib": gib, "raw_s": loads["raw read"].values, "runyard_s": loads["runyard load"].values,
                      "raw_one_buffer_s": loads["raw read, one buffer"].values})
        report.note(_one_buffer_note("one process", loads))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def show(samples: dict[str, Samples], gib: float) -> None:
    for name, s in samples.items():
        print(f"  {name:<28} {s.spread()} s   ({gib / s.median:.2f} GiB/s)")


# -- world size 2 ------------------------------------------------------------------------------------------


def sharded(args, report: Report) -> None:
    print("== world size 2 under torchrun: sharded save (torch.distributed.checkpoint, DDP) ==", flush=True)
    with tempfile.TemporaryDirectory(prefix="runyard-ckpt-bench-", dir=args.dir) as tmp:
        out = Path(tmp) / "result.json"
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                __file__, "--sharded-worker", str(out), "--repeats", str(args.repeats),
                "--step-tokens", str(args.step_tokens), "--d-model",
                str(args.d_model), "--layers", str(args.layers), "--vocab", str(args.vocab), "--dir", tmp]
        subprocess.run(argv, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
        result = json.loads(out.read_text())
    gib = result["gib"]
    samples = {name: Samples(v) for name, v in result["seconds"].items()}
    show({k: v for k, v in samples.items() if k not in ("async stall", "train step")}, gib)
    print(f"  {'async save: training stall':<28} {samples['async stall'].spread()} s")
    after = Samples(result["next_step_seconds"])
    print(f"  {'training step':<28} {samples['train step'].spread()} s alone, {after.spread()} s after an async save")
    report.note(f"the training step ({args.step_tokens} tokens a rank) after an async save took {after.median:.3g} s "
                f"({after.spread()}) against {samples['train step'].median:.3g} s ({samples['train step'].spread()}) "
                "without one: the write going on behind it shares the cores (its stall is in the async ratio)")
    report.ratio("checkpoint_save_sharded_ws2", paired_ratio(samples["raw write"], samples["runyard save"]),
                 "2 ranks each raw-writing half the bytes + fsync", ">=", 0.8,
                 {"gib": gib, **result["seconds"]})
    report.ratio("checkpoint_async_stall_ws2", paired_ratio(samples["async stall"], samples["runyard save"]),
                 "runyard's own synchronous sharded save", "<=", 0.1, {"gib": gib})
    loads = {name: Samples(v) for name, v in result["load_seconds"].items()}
    print("== world size 2: sharded load into model + optimizer (every rank holds the whole state) ==")
    show(loads, gib)
    report.ratio("checkpoint_load_sharded_ws2", paired_ratio(loads["raw read"], loads["runyard load"]),
                 "2 ranks each raw-reading the whole state's bytes (what DDP ranks hold) into their live tensors",
                 ">=", 0.8, {"gib": gib, **result["load_seconds"]})
    report.note(_one_buffer_note("sharded", loads))


def _one_buffer_note(which: str, loads: dict[str, Samples]) -> str:
    one, live = loads["raw read, one buffer"], loads["raw read"]
    return (f"{which} load: the raw read into one buffer took {one.spread()} s against {live.spread()} s into "
            "the live tensors; runyard's load over the one-buffer read: "
            f"{paired_ratio(one, loads['runyard load']).median:.3g}")


def sharded_worker(args) -> None:
    torch.set_num_threads(1)
    ctx = parallel.setup("cpu")
    setup = build(args, ctx)
    tensors = state_tensors(setup)
    mine = halves(tensors, ctx.world_size)[ctx.rank]
    root = args.dir / "ws2"
    raw_file = root / f"raw-{ctx.rank}.bin"
    ckpt_dir = root / "ckpt"
    if ctx.is_main:
        root.mkdir(parents=True, exist_ok=True)
    parallel.barrier(ctx)

    def clear() -> None:
        raw_file.unlink(missing_ok=True)
        if ctx.is_main:
            shutil.rmtree(ckpt_dir, ignore_errors=True)
        parallel.barrier(ctx)

    def timed(fn) -> float:
        clear()
        t0 = time.perf_counter()
        fn()
        parallel.barrier(ctx)
        return time.perf_counter() - t0

    def sync_save() -> None:
        ckpt.save(setup.state, ckpt_dir, 1, {}, ctx, wait=True, use_async=False)

    # The training step that follows a save: its forward and backward, then the optimizer's step, before
    # which the async save's deferred copies are made (train/checkpoint/deferred_copies.py).
    generator = torch.Generator().manual_seed(ctx.rank)
    tokens = torch.randint(0, args.vocab, (1, args.step_tokens + 1), generator=generator)

    def optimizer_step() -> float:
        """The optimizer's step; returns how long it waited before stepping: the pre-hook an async save
        registered runs before the one registered here."""
        t0, waited = time.perf_counter(), []
        handle = setup.optimizer.register_step_pre_hook(lambda *_: waited.append(time.perf_counter() - t0))
        setup.optimizer.step()
        handle.remove()
        setup.optimizer.zero_grad(set_to_none=True)
        return waited[0]

    def forward_and_backward() -> None:
        forward_backward(setup.module, tokens[:, :-1], tokens[:, 1:], 1.0 / args.step_tokens, ctx.device, "fp32")

    def train_step() -> float:
        t0 = time.perf_counter()
        forward_and_backward()
        optimizer_step()
        return time.perf_counter() - t0

    next_step_s: list[float] = []

    def async_save() -> float:
        clear()
        t0 = time.perf_counter()
        ckpt.save(setup.state, ckpt_dir, 1, {}, ctx, wait=False, use_async=True)
        stall = time.perf_counter() - t0  # the loop goes on training from here
        t1 = time.perf_counter()
        forward_and_backward()
        stall += optimizer_step()  # the loop waits again only for the copies the write still needs
        next_step_s.append(parallel.all_reduce_max(time.perf_counter() - t1, ctx))
        ckpt.wait_pending()
        parallel.barrier(ctx)
        return stall

    contenders = {"raw write": lambda: timed(lambda: raw_write(raw_file, mine)),
                  "runyard save": lambda: timed(sync_save), "async stall": async_save, "train step": train_step}
    for fn in contenders.values():  # warm-up: the stager's buffers, the process groups
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            elapsed = parallel.all_reduce_max(contenders[name](), ctx)  # the slowest rank is the figure
            seconds[name].append(elapsed)
        if ctx.is_main:
            print(f"  round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {seconds[n][-1]:.3g}s" for n in names),
                  file=sys.stderr, flush=True)
    load_seconds = sharded_loads(args, setup, tensors, ctx, root, sync_save)
    clear()
    if ctx.is_main:
        args.sharded_worker.write_text(json.dumps({"gib": nbytes(tensors) / 2**30, "seconds": seconds,
                                                   "next_step_seconds": next_step_s[1:],  # [0]: the warm-up
                                                   "load_seconds": load_seconds}))
    parallel.teardown()


def sharded_loads(args, setup: TrainSetup, tensors: list[torch.Tensor], ctx: parallel.DistContext, root: Path,
                  sync_save) -> dict[str, list[float]]:
    """The sharded checkpoint read back into every rank's model and optimizer (torch.distributed.checkpoint's
    load: under DDP each rank holds, so reads, the whole state), against each rank raw-reading the same bytes
    from one file into its live tensors, concurrently, between the same barriers."""
    sync_save()
    whole = root / "raw-whole.bin"
    if ctx.is_main:
        raw_write(whole, tensors)
    parallel.barrier(ctx)
    ref = ckpt.latest_good(root / "ckpt")
    dest = torch.zeros(whole.stat().st_size, dtype=torch.uint8)  # touched once, as live tensors are

    def timed(fn) -> float:
        parallel.barrier(ctx)
        t0 = time.perf_counter()
        fn()
        parallel.barrier(ctx)
        return time.perf_counter() - t0

    contenders = {"raw read": lambda: timed(lambda: raw_read(whole, tensors)),
                  "runyard load": lambda: timed(lambda: ckpt.load_from(setup.state, ref.path, ctx)),
                  "raw read, one buffer": lambda: timed(lambda: raw_read_one_buffer(whole, dest))}
    for fn in contenders.values():  # warm-up: the page cache holds both, as it would after a save
        fn()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for r in range(args.repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            seconds[name].append(parallel.all_reduce_max(contenders[name](), ctx))
        if ctx.is_main:
            print(f"  load round {r + 1}/{args.repeats}: " + ", ".join(f"{n} {seconds[n][-1]:.3g}s" for n in names),
                  file=sys.stderr, flush=True)
    if ctx.is_main:
        whole.unlink(missing_ok=True)
    return seconds


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.sharded_worker:
        sharded_worker(args)
        return 0
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    report = Report("checkpoint_io", args)
    report.note(f"load average at start {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    one_process(args, report)
    if not args.skip_sharded:
        sharded(args, report)
    return report.finish()


if __name__ == "__main__":
    raise SystemExit(main())
