"""Calibration: a few real measurements on the machine at hand, so that a plan needs no guessed throughput.

- `measure_machine`: the device a run would use here (as `resources.device` resolves), its matmul rate
  (a short GEMM), the disk's write rate under the run directory (a file written and fsynced) and the
  framework's resident memory (this process, which has imported what a run imports).
- `calibrate_stage`: a few real training steps of a stage's own model at its own micro-batch, through the
  training loop's own `forward_backward` and AdamW, then held-out forward passes and (for a model with a
  KV cache) single-token decode steps. Model and batches are drawn from a fixed seed, so everything it
  reports except the timings is the same on every call.

Every measurement is bounded: a stage takes timed steps until `budget_s` seconds have passed (its steps are
timed over a time budget, not counted, so a cheap step is measured many times and the spread across steps
is reported as the figure's stability) or `max_steps` were taken, at least one timed step after one
warm-up step. A model whose training state would not fit
in half the memory free here, or whose first step would take longer than the budget by the FLOP count,
is not run; its plan falls back to the device table.
"""

from __future__ import annotations

import contextlib
import os
import resource
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from runyard.model.compute import (
    apply_activation_checkpointing,
    autocast_for,
    forward_backward,
    resolve_device,
)
from runyard.model.registry import ModelFamily
from runyard.plan.devices import device, kind_of_cuda_name

CALIBRATION_SEED = 20240601  # model weights and batches of every calibration: fixed, so reports repeat
BYTES_PER_PARAM_STATE = 16  # fp32 weights, gradients and AdamW's two moments


@dataclass(frozen=True)
class Machine:
    """The machine at hand, as a run of this spec would use it."""

    kind: str  # a device-table kind: `cpu`, or the GPU's
    torch_device: str
    devices: int  # CPU cores the run's threads use, or 1 GPU
    matmul_flops: float  # measured FLOP/s of a square GEMM (fp32 on CPU, bf16 on GPU)
    disk_write_bytes_s: float  # measured: a file written and fsynced under the run directory
    framework_rss_bytes: int  # resident memory of a process that has imported runyard's run stack
    free_memory_bytes: int
    calibrated: bool = True


@dataclass(frozen=True)
class StageCalibration:
    """Timings of one stage's model on the machine at hand; `steps` timed training steps."""

    stage: str
    micro_batch: int
    steps: int
    forward_backward_s: float  # one micro-batch, forward and backward (median)
    optimizer_s: float  # one AdamW step with gradient clipping (median)
    first_step_extra_s: float  # the warm-up step over a steady one (allocation, kernel selection)
    forward_s: float  # one held-out micro-batch without gradients (median)
    decode_token_s: float | None  # one token of single-sequence decoding with a KV cache (median)
    wall_s: float  # what the calibration itself took
    peak_bytes: int | None = None  # memory at the peak over what was resident before the model was built
    spread: float = 0.0  # the steps' stability: interquartile range of a step's time over its median


def relative_spread(values: list[float]) -> float:
    """How far repeated timings stray: the interquartile range over the median (max - min over the median
    for fewer than 4 values); 0 for one value."""
    if len(values) < 2:
        return 0.0
    ordered = sorted(values)
    n = len(ordered)
    low, high = (ordered[n // 4], ordered[(3 * n) // 4]) if n >= 4 else (ordered[0], ordered[-1])
    return (high - low) / max(_median(ordered), 1e-12)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _timed(fn: Callable[[], Any], dev: torch.device) -> float:
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return time.perf_counter() - t0


def resident_bytes() -> int:
    """This process's resident set size (Linux /proc; ru_maxrss elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def reset_peak_resident() -> bool:
    """Reset this process's resident high-water mark (Linux: /proc/self/clear_refs = 5); False where the
    kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_resident_bytes() -> int | None:
    """This process's resident high-water mark since the last reset (VmHWM), or None without /proc."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory_bytes() -> int:
    """Memory this machine can still give (MemAvailable), or the physical total when unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measure_matmul_flops(dev: torch.device, budget_s: float = 0.5) -> float:
    """FLOP/s of repeated square matmuls (fp32 on CPU, bf16 on CUDA) within about `budget_s`."""
    n = 4096 if dev.type == "cuda" else 512
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    gen = torch.Generator(device="cpu").manual_seed(CALIBRATION_SEED)
    a = torch.randn(n, n, generator=gen).to(dev, dtype)
    b = torch.randn(n, n, generator=gen).to(dev, dtype)
    _timed(lambda: a @ b, dev)  # warm-up: thread pool, kernel choice
    times: list[float] = []
    spent = 0.0
    while spent < budget_s or len(times) < 3:
        t = _timed(lambda: a @ b, dev)
        times.append(t)
        spent += t
        if len(times) >= 50:
            break
    return 2 * n**3 / _median(times)


def measure_disk_write(directory: Path, nbytes: int = 32 << 20) -> float:
    """Bytes/s of writing and fsyncing one `nbytes` file in `directory` (or its nearest existing parent)."""
    where = directory
    while not where.exists() and where != where.parent:
        where = where.parent
    block = os.urandom(1 << 20)
    fd, name = tempfile.mkstemp(prefix=".runyard-plan-", dir=where)
    try:
        t0 = time.perf_counter()
        with os.fdopen(fd, "wb") as f:
            for _ in range(max(1, nbytes >> 20)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        elapsed = time.perf_counter() - t0
    finally:
        os.unlink(name)
    return nbytes / max(elapsed, 1e-6)


def measure_machine(requested_device: str, threads: int | None, run_dir: Path) -> Machine:
    """Measure the machine a run with `resources.device = requested_device` would train on here."""
    dev = resolve_device(requested_device)
    framework = resident_bytes()
    if dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        kind = kind_of_cuda_name(name) or "h100-80gb"
        count = 1
        free = torch.cuda.mem_get_info(dev)[0]
    else:
        kind = "cpu"
        count = threads or torch.get_num_threads()
        free = available_memory_bytes()
    with _threads(threads):
        flops = measure_matmul_flops(dev)
    return Machine(kind, str(dev), count, flops, measure_disk_write(run_dir), framework, free)


def table_machine(kind: str, devices: int = 1) -> Machine:
    """A machine described by the device table alone (no measurement): `plan --no-calibrate`, or the
    recommended hardware when it is not the machine at hand."""
    d = device(kind)
    return Machine(kind, "cuda" if d.gpu else "cpu", devices, d.peak_flops * (devices if not d.gpu else 1),
                   2e9, 0, d.memory_bytes * devices, calibrated=False)


@contextlib.contextmanager
def _threads(n: int | None) -> Iterator[None]:
    """Run with `n` torch CPU threads (as the run's thread choice, runyard/system/cpus.py, makes it do), then restore."""
    saved = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def fits_here(parameters: int, activation_bytes: int, machine: Machine) -> bool:
    """Whether a calibration of this model leaves the machine at least half its free memory."""
    return parameters * BYTES_PER_PARAM_STATE + activation_bytes < machine.free_memory_bytes // 2


def calibrate_stage(
    stage: str,
    family: ModelFamily,
    config: Any,
    optim: Any,
    micro_batch: int,
    machine: Machine,
    precision: str,
    threads: int | None,
    budget_s: float = 3.0,
    max_steps: int = 200,
    decode: bool = True,
    recompute: tuple[str, int] = ("none", 1),
) -> StageCalibration | None:
    """Time real training steps of `family`'s model of `config` at `micro_batch` (see the module doc).
    None when the family offers no synthetic batch (it is estimated from FLOPs instead)."""
    dev = torch.device(machine.torch_device)
    started = time.perf_counter()
    memory = _PeakMemory(dev)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []), _threads(threads):
        torch.manual_seed(CALIBRATION_SEED)
        gen = torch.Generator(device="cpu").manual_seed(CALIBRATION_SEED)
        batch = family.synthetic_batch(config, micro_batch, gen)
        if batch is None:
            return None
        x, y = (t.to(dev) for t in batch)
        model = family.build(config).to(dev)
        apply_activation_checkpointing(family.checkpoint_units(model), *recompute)  # as the stage will train
        model.train()
        optimizer = torch.optim.AdamW(family.optimizer_groups(model, optim), lr=optim.lr, betas=optim.betas,
                                      eps=optim.eps, fused=True)  # as the stage's (train/loop.py)
        params = [p for p in model.parameters() if p.requires_grad]
        scale = 1.0 / y.numel()

        def fb() -> None:
            forward_backward(model, x, y, scale, dev, precision)

        def opt() -> None:
            torch.nn.utils.clip_grad_norm_(params, optim.grad_clip or float("inf"))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        first = _timed(fb, dev) + _timed(opt, dev)
        fbs, opts = [], []
        timing = time.perf_counter()  # the budget is the steady steps': a slow warm-up does not eat it
        while not fbs or (len(fbs) < max_steps and time.perf_counter() - timing < budget_s):
            fbs.append(_timed(fb, dev))
            opts.append(_timed(opt, dev))
        fwd = forward_seconds(model, x, dev, precision, started, budget_s)
        peak = memory.peak()
        decode_s = decode_token_seconds(model, dev, started, budget_s) if decode else None
    steady = _median(fbs) + _median(opts)
    steps = [a + b for a, b in zip(fbs, opts, strict=True)]
    return StageCalibration(
        stage=stage,
        micro_batch=micro_batch,
        steps=len(fbs),
        forward_backward_s=_median(fbs),
        optimizer_s=_median(opts),
        first_step_extra_s=max(0.0, first - steady),
        forward_s=fwd,
        decode_token_s=decode_s,
        wall_s=time.perf_counter() - started,
        peak_bytes=peak,
        spread=relative_spread(steps),
    )


class _PeakMemory:
    """The peak memory over what is resident now: the process's (CPU) or the device's allocations (CUDA)."""

    def __init__(self, dev: torch.device):
        self.dev = dev
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
            self.base = torch.cuda.memory_allocated(dev)
            self.works = True
        else:
            self.base = resident_bytes()
            self.works = reset_peak_resident()

    def peak(self) -> int | None:
        if self.dev.type == "cuda":
            return torch.cuda.max_memory_allocated(self.dev) - self.base
        hwm = peak_resident_bytes() if self.works else None
        return None if hwm is None else max(0, hwm - self.base)


def forward_seconds(model: torch.nn.Module, x: torch.Tensor, dev: torch.device, precision: str,
                    started: float | None = None, budget_s: float = 1.0) -> float:
    """Median seconds of a forward pass of batch `x` without gradients (1 to 3 passes within the budget)."""
    started = time.perf_counter() if started is None else started
    was_training = model.training
    model.eval()

    def fwd() -> None:
        with torch.no_grad(), autocast_for(dev, precision):
            model(x).float()

    times = [_timed(fwd, dev)]
    while len(times) < 3 and time.perf_counter() - started < budget_s:
        times.append(_timed(fwd, dev))
    model.train(was_training)
    return _median(times)


def decode_token_seconds(model: torch.nn.Module, dev: torch.device, started: float | None = None,
                         budget_s: float = 1.0) -> float | None:
    """Median seconds of one token decoded at a time with a KV cache, as the serving engine decodes (at
    least 4 tokens, more while `budget_s` since `started` lasts, at most 16); None for a model without a
    KV cache. The model's training mode is restored."""
    started = time.perf_counter() if started is None else started
    new_cache = getattr(model, "new_kv_cache", None)
    if new_cache is None:
        return None
    was_training = model.training
    model.eval()
    cache = new_cache(batch_size=1)
    times: list[float] = []
    with torch.inference_mode():
        token = torch.zeros((1, 1), dtype=torch.long, device=dev)
        model(token, kv_cache=cache, start_pos=0)  # warm-up, and position 0 filled
        pos = 1
        limit = getattr(getattr(model, "cfg", None), "context_length", 8)
        while pos < min(limit, 17) and (len(times) < 4 or time.perf_counter() - started < budget_s):
            times.append(_timed(lambda p=pos: model(token, kv_cache=cache, start_pos=p), dev))
            pos += 1
    model.train(was_training)
    return _median(times) if times else None
