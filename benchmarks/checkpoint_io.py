"""Checkpoint I/O: runyard's sharded checkpoint against the raw cost of the same bytes, same run.

For a ~110M-parameter model (GPT-2-small-like: 12 layers, 768 wide, 32k vocabulary) with its AdamW state:

1. save throughput: runyard's save (torch.distributed.checkpoint write + fsync, checksum manifest, atomic
   rename) against a raw sequential write of the same number of bytes with one fsync. Target >= 0.8x.
2. training stall: how long an async save blocks the training loop (copy of the state to CPU memory)
   against a synchronous save of the same state. Target <= 0.1x.
3. load: reading the checkpoint back into model and optimizer, against a raw sequential read of the
   same bytes.

Run: `python benchmarks/checkpoint_io.py [--d-model 768 --layers 12 --vocab 32000 --dir /tmp]`.
The page cache is dropped neither before writes nor before reads (that needs root); the raw peers see
the same conditions, so the ratios compare like with like.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from runyard.model.transformer import ModelConfig, Transformer
from runyard.train import checkpoint as ckpt
from runyard.train import dist_checkpoint, parallel
from runyard.train.loop import TrainSetup


class _Position:
    """The loader's only part a checkpoint reads; a benchmark has no data."""

    def state_dict(self) -> dict:
        return {"position": 0}

    def load_state_dict(self, state: dict) -> None:
        pass


def build(args) -> TrainSetup:
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=args.vocab, d_model=args.d_model, n_layers=args.layers, n_heads=12, n_kv_heads=12,
                      ffn_hidden=4 * args.d_model, context_length=1024, tie_embeddings=False)
    model = Transformer(cfg)
    opt = torch.optim.AdamW(model.param_groups(0.1), lr=1e-4)
    for p in model.parameters():  # one real step so the optimizer holds its two moments per parameter
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    opt.zero_grad(set_to_none=True)
    return TrainSetup(model, model, cfg, opt, _Position())


def state_bytes(setup: TrainSetup) -> list[torch.Tensor]:
    tensors = list(setup.model.state_dict().values())
    for s in setup.optimizer.state.values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    return tensors


def raw_write(path: Path, tensors: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            f.write(t.contiguous().view(torch.uint8).numpy().tobytes() if t.dim() else t.numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def raw_read(path: Path) -> float:
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=2, help="best of N for each measurement")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    ctx = parallel.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    setup = build(args)
    params = setup.model.num_parameters()
    tensors = state_bytes(setup)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    print(f"model: {params / 1e6:.1f}M parameters; model + AdamW state: {nbytes / 2**30:.2f} GiB")

    root = Path(tempfile.mkdtemp(prefix="runyard-ckpt-bench-", dir=args.dir))
    try:
        raw, sync, stall, async_total, load, raw_load, dcp_only = [], [], [], [], [], [], []
        for i in range(args.repeats):
            raw_file = root / f"raw-{i}.bin"
            raw.append(raw_write(raw_file, tensors))
            raw_load.append(raw_read(raw_file))
            raw_file.unlink()

            d = root / f"sync-{i}"
            t0 = time.perf_counter()
            dist_checkpoint.save_sharded(setup, d, 1, {}, ctx, wait=True, use_async=False)
            sync.append(time.perf_counter() - t0)
            ref = ckpt.latest_good(d)
            t0 = time.perf_counter()
            dist_checkpoint.load_any(setup, ref, ctx)
            load.append(time.perf_counter() - t0)
            shutil.rmtree(d)

            d = root / f"dcp-only-{i}"  # the shard write alone, without runyard's checksums and commit
            model_sd, optim_sd = get_state_dict(setup.model, setup.optimizer)
            t0 = time.perf_counter()
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(d), no_dist=True)
            dcp_only.append(time.perf_counter() - t0)
            shutil.rmtree(d)

            d = root / f"async-{i}"
            t0 = time.perf_counter()
            dist_checkpoint.save_sharded(setup, d, 1, {}, ctx, wait=False, use_async=True)
            stall.append(time.perf_counter() - t0)  # the loop would go on training from here
            dist_checkpoint.wait_pending()
            async_total.append(time.perf_counter() - t0)
            shutil.rmtree(d)
        on_disk = nbytes
        raw_s, sync_s, stall_s, load_s, raw_load_s = min(raw), min(sync), min(stall), min(load), min(raw_load)
        gib = on_disk / 2**30
        print(f"raw sequential write + fsync (peer): {raw_s:.2f} s  ({gib / raw_s:.2f} GiB/s)")
        print(f"runyard sharded save, sync:          {sync_s:.2f} s  ({gib / sync_s:.2f} GiB/s)"
              f"   ratio {raw_s / sync_s:.2f}x of raw (target >= 0.8x)")
        print(f"  of which the DCP shard write alone: {min(dcp_only):.2f} s   ratio {raw_s / min(dcp_only):.2f}x of raw; "
              "the rest is the checksum manifest and the atomic commit")
        print(f"runyard async save: training stall   {stall_s:.3f} s, written and committed in {min(async_total):.2f} s"
              f"   stall ratio {stall_s / sync_s:.3f}x of a sync save (target <= 0.1x)")
        print(f"raw sequential read (peer):          {raw_load_s:.2f} s  ({gib / raw_load_s:.2f} GiB/s)")
        print(f"runyard load into model + optimizer: {load_s:.2f} s  ({gib / load_s:.2f} GiB/s)"
              f"   ratio {raw_load_s / load_s:.2f}x of raw read")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
