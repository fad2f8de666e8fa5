"""Training against a lifetime of inference: what serving the model costs per day on the hardware that serves
it cheapest, and the day on which its cumulative cost overtakes what training it cost.

Serving is provisioned for the busiest hour (`traffic.peak_to_mean` times the day's mean) and paid around
the clock: devices = ceil(peak units/s / one replica's capacity) x its devices, at least one replica while
there is traffic, and a day costs devices x 24 h at the price per device-hour. Every kind in the device table
is a candidate for every family, a CPU core included; the cheapest day wins (ties: the table's order).
A replica's capacity:

- a table or image model's rows/s: its POST /v1/predict measured on this machine at one row and at a batch,
  scaled to other kinds by the device table (serving_capacity.py); stated figures when nothing was measured;
- a decoder's tokens/s: measured decoding here on a CPU where the plan calibrated, else the roofline of
  batched decoding: one step reads the weights (bf16) and every sequence's KV cache at `decode_bandwidth` of
  the memory bandwidth, or computes each token's forward FLOPs at `decode_compute` of peak, whichever is
  slower, and never faster than the step's fixed part (`decode_step_floor_s`: sampling, the scheduler's
  Python and a host sync, plus the kernel launches of every block), which bounds a tiny model; the batch is
  as large as memory allows (at most 256 sequences of tokens_per_request each).

The seed's table (tables serve on CPU; images on CPU, or a modest GPU when traffic needs one; language
models on GPUs sized to concurrency) is a check, not a rule: where the arithmetic chooses otherwise the
lifetime says so (`Lifetime.check`).

The crossover day is the first whole day at whose end cumulative inference cost exceeds the training cost:
floor(training / per_day) + 1; no day when serving costs nothing.
"""

from __future__ import annotations

import io
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from matplotlib.figure import Figure

from runyard.model.registry import Sizing
from runyard.plan.cost import Cost, cost_of, format_money
from runyard.plan.devices import DEVICES, UTILISATION, Device, device, usable_memory
from runyard.plan.recommend import DATA_KINDS
from runyard.plan.serving_capacity import PredictTiming, predict_rows_per_s, stated_timing
from runyard.spec.job import CostsSpec
from runyard.system.files import atomic_write_bytes

SECONDS_PER_DAY = 86400
MAX_DECODE_BATCH = 256
# A decode step's fixed part, whatever the model's size (stated): sampling, the batching scheduler's Python and
# one host-device sync per step; and per block ~12 kernels (norms, projections, attention, MLP) at ~8 us a
# launch. A 2-block model steps at most every 2.2 ms (256 sequences: ~116k tokens/s on any device), where
# the bandwidth roofline alone gave a T4 86M tokens/s; a 32-block one every 5.2 ms.
DECODE_STEP_BASE_S = 2e-3
DECODE_STEP_PER_BLOCK_S = 1e-4
TABLE_DAYS = (1, 7, 30, 90, 180, 365, 730, 1095, 1825, 3650)


@dataclass(frozen=True)
class Traffic:
    """Requests per day and the units (tokens or rows) each one processes."""

    requests_per_day: float
    units_per_request: int
    unit: str  # token or row
    peak_to_mean: float = 2.0
    horizon_days: int = 365

    def __post_init__(self) -> None:
        if self.requests_per_day < 0 or not math.isfinite(self.requests_per_day):
            raise ValueError(f"requests per day must be a finite number, 0 or more; got {self.requests_per_day}")
        if self.units_per_request < 1:
            raise ValueError(f"{self.unit}s per request must be at least 1; got {self.units_per_request}")
        if self.peak_to_mean < 1:
            raise ValueError(f"peak_to_mean must be at least 1; got {self.peak_to_mean}")

    @property
    def peak_units_per_s(self) -> float:
        return self.requests_per_day * self.units_per_request / SECONDS_PER_DAY * self.peak_to_mean


@dataclass(frozen=True)
class Capacity:
    """One serving replica of `devices_per_replica` devices of `kind`: units/s, and how it is known."""

    kind: str
    devices_per_replica: int
    units_per_s: float
    how: str


@dataclass(frozen=True)
class Serving:
    capacity: Capacity
    replicas: int
    devices: int
    cost_per_day: Cost  # one day of the provisioned devices


@dataclass
class Lifetime:
    traffic: Traffic
    training: Cost
    serving: Serving
    crossover_day: int | None
    table: list[dict] = field(default_factory=list)
    candidates: list[dict] = field(default_factory=list)
    check: str = ""  # the seed's table against the choice

    def to_dict(self) -> dict:
        return {
            "traffic": asdict(self.traffic),
            "training": self.training.to_dict(),
            "serving": {
                "kind": self.serving.capacity.kind,
                "devices": self.serving.devices,
                "replicas": self.serving.replicas,
                "devices_per_replica": self.serving.capacity.devices_per_replica,
                "units_per_s_per_replica": self.serving.capacity.units_per_s,
                "capacity_how": self.serving.capacity.how,
                "cost_per_day": self.serving.cost_per_day.to_dict(),
                "cost_per_million_requests": self.cost_per_million_requests,
            },
            "crossover_day": self.crossover_day,
            "table": self.table,
            "candidates": self.candidates,
            "check": self.check,
        }

    @property
    def cost_per_million_requests(self) -> int | None:
        if self.traffic.requests_per_day <= 0:
            return None
        return math.ceil(self.serving.cost_per_day.minor_units * 1_000_000 / self.traffic.requests_per_day)

    def lines(self) -> list[str]:
        """The lifetime as `runyard plan --traffic` prints it."""
        cur = self.training.currency
        t, s = self.traffic, self.serving
        out = [
            f"traffic: {t.requests_per_day:,.0f} requests/day x {t.units_per_request:,} {t.unit}s "
            f"(peak {t.peak_to_mean:g}x the mean: {t.peak_units_per_s:,.1f} {t.unit}s/s)",
            f"training cost: {format_money(self.training.minor_units, cur)} "
            f"({self.training.devices} x {self.training.kind}, {self.training.device_hours:,.2f} device-hours, "
            f"{self.training.energy_kwh:,.2f} kWh)",
            f"serving: {s.devices} x {s.capacity.kind} ({s.replicas} replica{'s' if s.replicas != 1 else ''} of "
            f"{s.capacity.devices_per_replica}; {s.capacity.units_per_s:,.1f} {t.unit}s/s each)",
            f"serving capacity: {s.capacity.units_per_s:,.1f} {t.unit}s/s per replica of {s.capacity.kind}: "
            f"{s.capacity.how}",
            f"inference cost per day: {format_money(s.cost_per_day.minor_units, cur)} "
            f"({s.cost_per_day.energy_kwh:,.2f} kWh/day)"
            + (f", {format_money(self.cost_per_million_requests, cur)} per million requests"
               if self.cost_per_million_requests is not None else ""),
            *([f"check against the seed's table: {self.check}"] if self.check else []),
            "cumulative inference overtakes training on "
            + (f"day {self.crossover_day:,}" if self.crossover_day is not None else "no day (serving costs nothing)"),
            "",
            "| day | cumulative inference | training | inference / training |",
            "| --- | --- | --- | --- |",
        ]
        for row in self.table:
            ratio = row["inference"] / self.training.minor_units if self.training.minor_units else math.inf
            out.append(f"| {row['day']:,} | {format_money(row['inference'], cur)} | "
                       f"{format_money(self.training.minor_units, cur)} | {ratio:,.2f} |")
        return out


def crossover_day(training_minor_units: int, inference_per_day: int) -> int | None:
    """The first day at whose end cumulative inference cost exceeds the training cost; None when serving
    costs nothing."""
    if training_minor_units < 0 or inference_per_day < 0:
        raise ValueError("costs must not be negative")
    if inference_per_day == 0:
        return None
    return training_minor_units // inference_per_day + 1


def decoder_capacity(d: Device, sizing: Sizing, tokens_per_request: int) -> Capacity:
    """Tokens/s of one replica decoding in batches on devices of kind `d` (roofline; see the module doc)."""
    weights = sizing.parameters * 2  # bf16
    per_sequence = max(1, sizing.cache_bytes_per_unit * tokens_per_request)
    per_replica = max(1, math.ceil(weights / max(1, usable_memory(d) * 0.8)))
    memory = usable_memory(d) * per_replica
    batch = max(1, min(MAX_DECODE_BATCH, int((memory - weights) // per_sequence)))
    # Each sequence is on average half-way through its request's tokens.
    step_bytes = weights + batch * per_sequence / 2
    memory_s = step_bytes / (d.bandwidth_bytes_s * per_replica * UTILISATION["decode_bandwidth"])
    compute_s = batch * sizing.forward_flops_per_unit / (d.peak_flops * per_replica * UTILISATION["decode_compute"])
    floor_s = decode_step_floor_s(sizing)
    step = max(memory_s, compute_s, floor_s)
    if floor_s >= max(memory_s, compute_s):
        how = (f"device table: batches of {batch} sequences, bound by the step's fixed part "
               f"({floor_s * 1e3:.1f} ms: sampling, scheduling and {sizing.recomputable_units} blocks' kernel launches)")
        return Capacity(d.kind, per_replica, batch / step, how)
    bound = "memory bandwidth" if memory_s >= compute_s else "compute"
    how = (f"device table: batches of {batch} sequences, {bound}-bound at "
           f"{UTILISATION['decode_bandwidth' if bound == 'memory bandwidth' else 'decode_compute']:.0%} of its "
           f"{'bandwidth' if bound == 'memory bandwidth' else 'peak'}")
    return Capacity(d.kind, per_replica, batch / step, how)


def decode_step_floor_s(sizing: Sizing) -> float:
    """The least time one batched decode step takes, however small the model (DECODE_STEP_BASE_S and
    DECODE_STEP_PER_BLOCK_S for each of the family's blocks)."""
    return DECODE_STEP_BASE_S + DECODE_STEP_PER_BLOCK_S * sizing.recomputable_units


def predict_capacity(d: Device, sizing: Sizing, traffic: Traffic, timing: PredictTiming | None,
                     forward_on_device: bool) -> Capacity:
    """Rows/s of one replica (one device) of a table or image model: its /v1/predict timing (measured here,
    else stated) scaled to `d` (serving_capacity.py)."""
    timing = timing or stated_timing(sizing, device("cpu"))
    rate, how = predict_rows_per_s(d, timing, sizing, traffic.units_per_request, forward_on_device)
    return Capacity(d.kind, 1, rate, how)


def serving_for(capacity: Capacity, traffic: Traffic, costs: CostsSpec) -> Serving:
    """Devices provisioned for the traffic's peak on `capacity`'s hardware, and a day of them."""
    if traffic.requests_per_day <= 0:
        replicas = 0
    else:
        replicas = max(1, math.ceil(traffic.peak_units_per_s / capacity.units_per_s))
    devices = replicas * capacity.devices_per_replica
    return Serving(capacity, replicas, devices, cost_of(capacity.kind, devices, SECONDS_PER_DAY, costs))


def choose_serving(task: str, capacities: list[Capacity], traffic: Traffic, costs: CostsSpec) -> tuple[Serving, list[Serving]]:
    """The cheapest day among the candidate kinds (ties: the first, in the table's order)."""
    options = [serving_for(c, traffic, costs) for c in capacities]
    best = min(options, key=lambda o: (o.cost_per_day.minor_units, options.index(o)))
    return best, options


def seed_check(task: str, best: Serving, options: list[Serving]) -> str:
    """What the seed's table would serve on, against the arithmetic's choice: empty where they agree."""
    kind = DATA_KINDS[task]
    on_cpu = best.capacity.kind == "cpu"
    gpu = [o for o in options if o.capacity.kind != "cpu"]
    cheapest_gpu = min(gpu, key=lambda o: o.cost_per_day.minor_units) if gpu else None
    if kind == "tabular" and not on_cpu:
        return (f"the table says CPU for a tabular model; {best.capacity.kind} is cheaper at this traffic "
                f"({best.devices} of them)")
    if kind == "text" and on_cpu and cheapest_gpu is not None:
        return (f"the table says GPUs for a language model; {best.devices} CPU core{'s' if best.devices != 1 else ''} "
                f"carry this traffic for less than {cheapest_gpu.devices} x {cheapest_gpu.capacity.kind} "
                f"({cheapest_gpu.cost_per_day.minor_units:,} against {best.cost_per_day.minor_units:,} minor units a day)")
    return ""


def lifetime_of(task: str, training: Cost, capacities: list[Capacity], traffic: Traffic, costs: CostsSpec) -> Lifetime:
    """Training cost against serving cost over `traffic.horizon_days` (see the module doc)."""
    best, options = choose_serving(task, capacities, traffic, costs)
    per_day = best.cost_per_day.minor_units
    days = sorted({d for d in TABLE_DAYS if d <= traffic.horizon_days} | {traffic.horizon_days})
    table = [{"day": d, "inference": per_day * d, "training": training.minor_units} for d in days]
    candidates = [{"kind": o.capacity.kind, "devices": o.devices, "units_per_s_per_replica": o.capacity.units_per_s,
                   "cost_per_day": o.cost_per_day.minor_units, "how": o.capacity.how} for o in options]
    return Lifetime(traffic, training, best, crossover_day(training.minor_units, per_day), table, candidates,
                    seed_check(task, best, options))


def serving_kinds(task: str) -> tuple[str, ...]:
    """The kinds any task may serve on: every kind in the device table, a CPU core first."""
    return tuple(DEVICES)


def table_capacity(kind: str, task: str, sizing: Sizing, traffic: Traffic, timing: PredictTiming | None = None,
                   forward_on_device: bool = True) -> Capacity:
    """A kind's capacity from the device table: a decoder's roofline, or a table or image model's /v1/predict
    timing (`timing`, measured here; else the stated one) scaled to the kind."""
    d = device(kind)
    if sizing.cache_bytes_per_unit and traffic.unit == "token":
        return decoder_capacity(d, sizing, traffic.units_per_request)
    return predict_capacity(d, sizing, traffic, timing, forward_on_device)


def plot_lifetime(lifetime: Lifetime, path: Path) -> Path:
    """lifetime.png: cumulative inference cost by day against the training cost, the crossover marked."""
    cur = lifetime.training.currency
    horizon = lifetime.traffic.horizon_days
    per_day = lifetime.serving.cost_per_day.minor_units / 100
    fig = Figure(figsize=(8, 4.5))
    ax = fig.subplots()
    ax.plot([0, horizon], [0, per_day * horizon], label=f"cumulative inference ({lifetime.serving.devices} x "
            f"{lifetime.serving.capacity.kind})")
    ax.axhline(lifetime.training.minor_units / 100, color="tab:red", linestyle="--",
               label=f"training ({lifetime.training.devices} x {lifetime.training.kind})")
    if lifetime.crossover_day is not None and lifetime.crossover_day <= horizon:
        ax.axvline(lifetime.crossover_day, color="grey", linewidth=0.8)
        ax.annotate(f"day {lifetime.crossover_day}", (lifetime.crossover_day, lifetime.training.minor_units / 100),
                    textcoords="offset points", xytext=(6, 6))
    ax.set_xlabel("days of serving")
    ax.set_ylabel(f"cost ({cur}, major units)")
    ax.set_title(f"Training against a lifetime of inference ({lifetime.traffic.requests_per_day:,.0f} requests/day)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    atomic_write_bytes(path, buf.getvalue())
    return path
