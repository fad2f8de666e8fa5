"""Serving capacity of a table or image model, measured on the export's own path: POST /v1/predict at one
row (or image) per request and at a batch, on this machine, then scaled to other hardware by the device
table.

A request's time is modelled as a fixed part and a part per row: t(r) = a + b·r, with a and b solved from
the two measured points (one row, and a batch of `batch_rows`). A replica's rows/s at the traffic's rows
per request r is then r / t(r). Of b, the share the model itself takes (`model_row_s`, the predictor's
forward timed alone on the same batch) is what an accelerator can speed up; the rest (HTTP, JSON, the
schema's validation and encoding, the drift window) runs on the serving process's CPU whatever the device.

- `cpu`: one core (the measurement runs with one thread), the measured t(r).
- a GPU kind: the host part measured here (a + (b - model_row_s)·r); the model part, for a family whose
  forward runs on the device (a network), its forward FLOPs per row at the device's peak times
  UTILISATION['train_other'] with a floor of GPU_CALL_FLOOR_S per request (a kernel launch and the copies);
  for one whose library runs on the host (trees, the linear model), the measured model part unchanged.

The measurement itself needs the serving stack, which sits above the planner: the caller passes it in as a
`PredictProbe` (runyard/run/serving_probe.py builds a model of the spec's shape, serves it through the real
/v1/predict app on loopback and times it). A measurement is cached per machine, family and configuration
under $RUNYARD_CACHE_DIR/serving (else ~/.cache/runyard/serving). Without a probe (`plan --no-calibrate`,
or no serving stack) the figures are the STATED ones below, and the capacity says so.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from runyard.model.registry import Sizing
from runyard.plan.devices import UTILISATION, Device
from runyard.system.cpus import cpu_model
from runyard.system.files import atomic_write_bytes

BATCH_ROWS = 1000  # the batch measured beside one row (the 1,000-row requests)
GPU_CALL_FLOOR_S = 2e-4  # a forward on a GPU: launches and the host-device copies of a small batch (stated)
CACHE_VERSION = 1

# Stated figures, used only when nothing is measured: a LightGBM table through /v1/predict on one core of a
# 2-core x86 machine (issue 28: 490-630 one-row requests/s, 19-26k rows/s in 1,000-row batches).
STATED_ONE_ROW_S = 1 / 550
STATED_BATCH_ROWS_PER_S = 22_000.0


@dataclass(frozen=True)
class PredictTiming:
    """Seconds per /v1/predict request at one row and at `batch_rows`, on `cores` CPU cores, and the model's
    own share per row (its forward alone, at the batch)."""

    one_row_s: float
    batch_rows: int
    batch_s: float
    model_row_s: float
    cores: int
    requests: int  # requests timed in all
    path: str  # what was timed
    measured: bool = True
    cached: bool = False

    @property
    def per_row_s(self) -> float:
        return max(0.0, (self.batch_s - self.one_row_s) / max(1, self.batch_rows - 1))

    @property
    def fixed_s(self) -> float:
        return max(0.0, self.one_row_s - self.per_row_s)

    def request_s(self, rows: int) -> float:
        return self.fixed_s + self.per_row_s * rows

    def rows_per_s(self, rows: int) -> float:
        return rows / self.request_s(rows)

    def describe(self) -> str:
        source = "measured here" + (" (cached for this machine)" if self.cached else "") if self.measured else \
            "stated, not measured"
        return (f"{source}: {self.path}: {1 / self.one_row_s:,.0f} one-row requests/s and "
                f"{self.batch_rows / self.batch_s:,.0f} rows/s in {self.batch_rows:,}-row requests on "
                f"{self.cores} core{'s' if self.cores != 1 else ''}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# (task, family name, family config, batch rows, seconds to spend) -> the timing
PredictProbe = Callable[[str, str, Any, int, float], PredictTiming]


def stated_timing(sizing: Sizing, cpu: Device) -> PredictTiming:
    """The stated table figures, plus the model's forward FLOPs per row at the CPU's stated utilisation
    (what an image model adds to a table's per-row cost)."""
    model_row_s = sizing.forward_flops_per_unit / (cpu.peak_flops * UTILISATION["cpu_of_matmul_peak"])
    batch_s = BATCH_ROWS / STATED_BATCH_ROWS_PER_S + model_row_s * BATCH_ROWS
    return PredictTiming(STATED_ONE_ROW_S + model_row_s, BATCH_ROWS, batch_s, model_row_s, 1, 0,
                         "POST /v1/predict of a LightGBM table on one core of a 2-core x86 machine (issue 28), "
                         "plus the model's forward FLOPs at the CPU's stated rate", measured=False)


def machine_key() -> str:
    """What makes a measurement this machine's: its processor, its core count and the Python and
    platform it runs."""
    return f"{platform.node()}|{cpu_model()}|{os.cpu_count()}|{platform.python_version()}|{platform.platform()}"


def cache_root() -> Path:
    base = os.environ.get("RUNYARD_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "runyard") / "serving"


def _cache_file(task: str, family: str, config: dict[str, Any], batch_rows: int) -> Path:
    blob = json.dumps({"v": CACHE_VERSION, "machine": machine_key(), "task": task, "family": family,
                       "config": config, "batch": batch_rows}, sort_keys=True, default=str)
    return cache_root() / f"{family}-{hashlib.sha256(blob.encode()).hexdigest()[:20]}.json"


def measured_timing(probe: PredictProbe, task: str, family: str, config: Any, config_dict: dict[str, Any],
                    batch_rows: int = BATCH_ROWS, budget_s: float = 2.0) -> PredictTiming:
    """The probe's timing of this family and configuration on this machine, from the cache when it was
    measured here before."""
    path = _cache_file(task, family, config_dict, batch_rows)
    try:
        return replace(PredictTiming(**json.loads(path.read_text(encoding="utf-8"))), cached=True)
    except (OSError, ValueError, TypeError):
        pass
    timing = probe(task, family, config, batch_rows, budget_s)
    with contextlib.suppress(OSError):  # an unwritable cache costs the next plan a measurement, nothing else
        atomic_write_bytes(path, json.dumps(timing.to_dict(), indent=1).encode())
    return timing


def predict_rows_per_s(d: Device, timing: PredictTiming, sizing: Sizing, rows: int, forward_on_device: bool
                       ) -> tuple[float, str]:
    """Rows/s of one replica on one device of `d` at `rows` per request, and how it was found (module doc)."""
    if not d.gpu:
        return timing.rows_per_s(rows), f"{timing.describe()}; at {rows:,} row{'s' if rows != 1 else ''}/request"
    host = timing.fixed_s + max(0.0, timing.per_row_s - timing.model_row_s) * rows
    if forward_on_device:
        model = max(GPU_CALL_FLOOR_S, rows * sizing.forward_flops_per_unit / (d.peak_flops * UTILISATION["train_other"]))
        model_how = (f"the forward on the {d.kind} at {UTILISATION['train_other']:.0%} of its peak "
                     f"(at least {GPU_CALL_FLOOR_S * 1e3:g} ms a request)")
    else:
        model = timing.model_row_s * rows
        model_how = "the model's library runs on the host, as measured"
    return rows / (host + model), (f"host part of {timing.describe()}; {model_how}; at {rows:,} "
                                   f"row{'s' if rows != 1 else ''}/request")
