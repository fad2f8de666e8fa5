"""The step reads nothing back to the host between log intervals: losses, gradient norms and token counts
stay on the device until the log (train.log_interval), where one readback serves the interval. Counted
with a TorchDispatchMode (`aten._local_scalar_dense`: .item(), float(), bool() of a tensor) and a patched
`Tensor.tolist` over whole stages of N1 and N2 steps: the extra steps may cost only their logs."""

from __future__ import annotations

import traceback

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from runyard.spec.job import parse_spec, resolved_stage
from runyard.train.loop import train_stage
from tests.train.test_loop_resume import CTX, prepared  # noqa: F401  (the fixture)

LOG_EVERY = 4


class CountReadbacks(TorchDispatchMode):
    """Host readbacks of tensor values; the optimizer's step counters are left out (torch keeps them on
    the host unless `capturable`, so reading them never waits for a device)."""

    def __init__(self):
        super().__init__()
        self.readbacks = 0
        self.device_asserts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and not _in_optimizer():
            self.readbacks += 1
        if func.overloadpacket is torch.ops.aten._assert_async:
            self.device_asserts += 1
        return func(*args, **(kwargs or {}))


def _in_optimizer() -> bool:
    return any("/torch/optim/" in f.filename for f in traceback.extract_stack())


def readbacks(prepared, tmp_path, steps: int, monkeypatch) -> tuple[int, int]:  # noqa: F811
    spec = parse_spec({
        "name": "sync", "seed": 5, "data": {"sources": [{"path": "unused"}]},
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "context_length": 16},
        "train": {"steps": steps, "batch_size": 2, "grad_accum": 2, "log_interval": LOG_EVERY},
        "eval": {"interval": 1000, "batches": 1}, "checkpoint": {"interval": 1000},
        "resources": {"device": "cpu"},
    })
    listed = [0]
    tolist = torch.Tensor.tolist

    def counted_tolist(self):
        listed[0] += 1
        return tolist(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    mode = CountReadbacks()
    with mode:
        train_stage(spec, resolved_stage(spec, "main"), prepared, tmp_path / f"s{steps}", CTX, show_progress=False)
    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    return mode.readbacks + listed[0], mode.device_asserts


@pytest.mark.slow
def test_steps_between_logs_read_nothing_back(prepared, tmp_path, monkeypatch):  # noqa: F811
    torch.set_num_threads(1)
    short, short_asserts = readbacks(prepared, tmp_path, LOG_EVERY, monkeypatch)
    long, long_asserts = readbacks(prepared, tmp_path, 4 * LOG_EVERY, monkeypatch)
    extra_logs = (4 * LOG_EVERY - LOG_EVERY) // LOG_EVERY
    print(f"readbacks: {short} over {LOG_EVERY} steps, {long} over {4 * LOG_EVERY} ({extra_logs} more logs)")
    assert long - short <= extra_logs  # one readback per log, none per step
    # the non-finite guard is a device-side assert per step (a readback on a CPU, not on a GPU)
    assert long_asserts - short_asserts == 3 * LOG_EVERY
