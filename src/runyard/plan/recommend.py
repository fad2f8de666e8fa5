"""Recommendations from the data and the model's size: which model family, and which hardware to train
and to serve on.

The family follows the seed material's table. Hardware is chosen by need, with the table as a check, not a
rule. Training (here): every kind in the device table, a CPU included, is a candidate; each gets the devices
its memory needs (FSDP shards of the state; a CPU's cores by the table's memory per core) and more, data
parallel, while the run would outlast the time it should finish in (DEFAULT_WITHIN_HOURS); its time is the
run's FLOPs at the kind's peak times a stated utilisation (a GPU also at least GPU_TRAIN_STEP_FLOOR_S per
micro-batch), its cost that time plus the lease's start (LEASE_START_S) at the price per device-hour. The
cheapest that finishes in time among the kinds buyers can get (devices.Device.available) wins; a scarce kind
only when no available one finishes in time, so a list price per FLOP alone never picks it. A family whose
library trains on the host (trees, the linear model) has only the CPU as a candidate. Serving is chosen the
same way, by the cheapest day at the traffic (lifetime.py). The seed's table:

| workload | family | train on | serve on |
| --- | --- | --- | --- |
| tabular | not a deep network (gradient-boosted trees) | CPU | CPU |
| image classification | a convolutional network | a GPU | CPU, or a modest GPU when the traffic needs one |
| language model | a decoder transformer | high-memory GPUs, as many as memory and time need | GPUs sized to concurrency |

"Simple, low-dimensional data usually doesn't need a deep neural network; complex, high-dimensional data
(images, language, audio) usually does": the family is runyard.model.choice's, the rule a run that leaves
`model.family` out chooses by too; this module explains it along the table.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from runyard.market.requirement import Interconnect
from runyard.model.choice import choose_family, needs_deep_network, no_family_message
from runyard.model.tabular import TableFacts
from runyard.plan.cost import TABLE_CURRENCY, discount_factor, format_money, money
from runyard.plan.devices import DEVICES, DEVICES_PER_NODE, UTILISATION, Device, device, usable_memory
from runyard.spec.job import CostsSpec

# Tasks by the kind of data they read.
DATA_KINDS = {
    "language_model": "text",
    "tabular_classification": "tabular",
    "tabular_regression": "tabular",
    "image_classification": "image",
}

DEFAULT_CPU_CORES = 4  # a tabular run's cores when resources.threads leaves it to the machine
DEFAULT_WITHIN_HOURS = 24.0  # the time a training run should finish in when nothing says otherwise (stated)
MAX_CPU_CORES = 64  # one server's cores: a CPU run does not span machines
MAX_DEVICES = 1024  # the most GPUs the plan lays a run over
# Billed before the first step: provisioning the machine, pulling the image and starting the run (stated: GPU
# clouds take minutes to hand over a machine with drivers and a CUDA image; a CPU VM about a minute).
LEASE_START_S = {"gpu": 300.0, "cpu": 60.0}
# A micro-batch's forward, backward and optimizer step on a GPU takes at least this however small the model:
# hundreds of kernel launches at ~5-10 us each and the Python around them (stated).
GPU_TRAIN_STEP_FLOOR_S = 3e-3
HIGH_MEMORY_BYTES = 80 * (1 << 30)  # the seed's "high-memory GPUs": 80 GiB and more
# The seed's sizes, as a check: parameters up to the bound -> what it expects.
SIZE_INTUITION = ((300e6, "small"), (20e9, "medium"), (100e9, "large"), (math.inf, "huge"))
SIZE_WORDS = {"small": "for a CPU or one GPU", "medium": "for one GPU or a few", "large": "for a few GPUs or many",
              "huge": "for many GPUs"}


@dataclass(frozen=True)
class DataFacts:
    """What the plan knows of the data before preparing it (or from a prepared copy in the cache)."""

    kind: str  # text, tabular or image
    files: int
    bytes: int
    rows: int | None = None  # documents, table rows or images (None: not counted)
    features: int | None = None  # table columns other than the target; pixels x channels for images
    classes: int | None = None
    image_shape: tuple[int, ...] | None = None  # (channels, height, width)
    tokens: int | None = None  # text: tokens of both splits (measured or estimated)
    vocab_size: int | None = None  # text: the tokenizer's (known once prepared)
    extra: dict[str, Any] = field(default_factory=dict)

    def config_facts(self, task: str) -> dict[str, Any]:
        """Keyword arguments a family's `config_from_spec` takes from the data (what train/batches.py and
        run/predictive.py read from the prepared data), here from what was counted before preparing it."""
        out: dict[str, Any] = {}
        for key in ("vocab_size", "features", "classes", "rows"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.image_shape is not None:
            out["channels"], out["height"], out["width"] = self.image_shape
            out["image_shape"] = self.image_shape
            if self.classes:
                out["shape"], out["n_classes"] = tuple(self.image_shape), self.classes
        if self.kind == "tabular":
            classes = self.classes if task.endswith("classification") else None  # regression: a value
            out["table"] = TableFacts(n_features=self.features or 1, categorical=(), n_classes=classes)
        return out

    def describe(self) -> str:
        if self.kind == "text":
            tokens = f", ~{self.tokens:,} tokens" if self.tokens else ""
            return f"text: {self.files:,} files, {self.bytes / 1e6:.1f} MB{tokens}"
        if self.kind == "tabular":
            return f"tabular: {self.rows or 0:,} rows x {self.features or 0:,} features"
        shape = "x".join(str(s) for s in self.image_shape) if self.image_shape else "?"
        return f"images: {self.rows or 0:,} of {shape}" + (f", {self.classes} classes" if self.classes else "")


@dataclass(frozen=True)
class FamilyChoice:
    family: str | None
    why: str


@dataclass(frozen=True)
class Hardware:
    """Devices of one kind, and why."""

    kind: str
    devices: int
    why: str
    interconnect: str = Interconnect.ETHERNET.value
    candidates: tuple[dict, ...] = ()  # every kind weighed (TrainingOption.to_dict)
    check: str = ""  # the seed's table against the choice; empty where they agree

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return describe_devices(self.kind, self.devices)


def describe_devices(kind: str, devices: int) -> str:
    """`2 x CPU cores`, `1 x h100-80gb`."""
    if kind == "cpu":
        return f"{devices} x CPU core{'s' if devices != 1 else ''}"
    return f"{devices} x {kind}"


def recommend_family(task: str, facts: DataFacts) -> FamilyChoice:
    """The registered family the data calls for: runyard.model.choice's (the rule a run chooses by too),
    explained along the seed's table."""
    choice = choose_family(task, facts.rows)
    if needs_deep_network(task):
        why = (f"{facts.describe()}: high-dimensional data, so a deep network "
               f"({'convolutional for images' if facts.kind == 'image' else 'a decoder transformer for text'})")
    else:
        why = f"{facts.describe()}: low-dimensional tabular data does not need a deep network"
        if choice.wanting_more_rows:
            passed_over = ", ".join(f.name for f in choice.wanting_more_rows)
            why += f"; {facts.rows} rows are too few for {passed_over} (< {choice.fewest_rows_wanted})"
    if choice.family is None:
        return FamilyChoice(None, f"{why}; {no_family_message(task)}")
    if not choice.family.trains_with_loop and choice.family.why_recommended:
        why += f"; {choice.family.why_recommended}"
    return FamilyChoice(choice.family.name, why)


@dataclass(frozen=True)
class TrainingOption:
    """One kind weighed for training: the devices it needs, how long and what it would cost, or why not."""

    kind: str
    devices: int
    seconds: float  # the run's steps on these devices (device table), without the lease's start
    cost: int  # minor units, the lease's start included; -1 when the kind is not a candidate
    fits_memory: bool
    within_time: bool
    available: bool
    why: str

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def candidate(self) -> bool:
        return self.fits_memory and self.cost >= 0


def lease_start_s(d: Device) -> float:
    """Seconds a lease of `d` is billed before the run's first step (LEASE_START_S)."""
    return LEASE_START_S["gpu" if d.gpu else "cpu"]


def training_seconds(d: Device, flops: float, utilisation: float, devices: int, micro_steps: int = 0) -> float:
    """The run's steps on `devices` of `d`: FLOPs at `utilisation` of peak (a CPU core: its matmul share), and on a
    GPU at least GPU_TRAIN_STEP_FLOOR_S per micro-batch, both divided over the data-parallel devices."""
    util = utilisation if d.gpu else UTILISATION["cpu_of_matmul_peak"]
    compute = flops / (d.peak_flops * util * devices)
    floor = micro_steps * GPU_TRAIN_STEP_FLOOR_S / devices if d.gpu else 0.0
    return max(compute, floor)


def _price(kind: str, costs: CostsSpec) -> int | None:
    """The spec's price of a device-hour of `kind`, or the table's; None where the spec's currency is not the
    table's and it gives no price for the kind (the candidate cannot be weighed in that currency)."""
    if kind in costs.prices:
        return costs.prices[kind]
    return device(kind).price_per_hour if costs.currency == TABLE_CURRENCY else None


def training_options(memory_per_replica: int, state_bytes: int, training_flops: float, utilisation: float,
                     threads: int | None, *, micro_steps: int = 0, within_s: float = DEFAULT_WITHIN_HOURS * 3600,
                     costs: CostsSpec | None = None, on_device: bool = True,
                     least_unsharded: int | None = None) -> list[TrainingOption]:
    """Every kind in the device table weighed for training (see `training_hardware`), in the table's order."""
    costs = costs or CostsSpec()
    priced_any = any(_price(k, costs) is not None for k in DEVICES)
    out = []
    for d in DEVICES.values():
        price = _price(d.kind, costs)
        if price is None and not priced_any:
            price = d.price_per_hour  # no kind priced in the spec's currency: ranked by the table's (cost_of then refuses)
        if not d.gpu:
            out.append(_cpu_option(d, price, memory_per_replica, training_flops, threads, within_s, costs))
        elif not on_device:
            out.append(TrainingOption(d.kind, 0, math.inf, -1, False, False, d.available,
                                      "the family's library trains on the host CPU: a GPU would idle"))
        else:
            out.append(_gpu_option(d, price, memory_per_replica, state_bytes, training_flops, utilisation,
                                   micro_steps, within_s, costs, least_unsharded))
    return out


def _cost(price: int | None, devices: int, seconds: float, d: Device, costs: CostsSpec) -> int:
    if price is None:
        return -1
    return money(price, devices, lease_start_s(d) + seconds, discount_factor(costs))


def _cpu_option(d: Device, price: int | None, need: int, flops: float, threads: int | None, within_s: float,
                costs: CostsSpec) -> TrainingOption:
    """CPU cores on one machine: resources.threads when the spec sets it (the run uses that many), else from
    DEFAULT_CPU_CORES doubling to MAX_CPU_CORES while the run would outlast `within_s`; at least the cores whose
    memory (the table's per core) holds the run."""
    by_memory = math.ceil(need / d.memory_bytes)
    cores = threads or DEFAULT_CPU_CORES
    if threads is None:
        cores = min(MAX_CPU_CORES, max(cores, by_memory))
        while training_seconds(d, flops, 0.0, cores) > within_s and cores < MAX_CPU_CORES:
            cores = min(MAX_CPU_CORES, cores * 2)
    seconds = training_seconds(d, flops, 0.0, cores)
    fits = cores * d.memory_bytes >= need
    why = (f"{describe_devices(d.kind, cores)} hold {_gib(need)}" if fits else
           f"{_gib(need)} needs {by_memory} cores' memory, more than {cores if threads else MAX_CPU_CORES} on one machine")
    cost = _cost(price, cores, seconds, d, costs) if fits else -1
    return TrainingOption(d.kind, cores, seconds, cost, fits, fits and seconds <= within_s, d.available, why)


def _gpu_option(d: Device, price: int | None, need: int, state_bytes: int, flops: float, utilisation: float,
                micro_steps: int, within_s: float, costs: CostsSpec, least_unsharded: int | None) -> TrainingOption:
    """Devices of a GPU kind: one when it holds the run; else FSDP shards of the state over as many as leave room
    for the rest (activations, evaluation), with every block recomputed when the activations alone exceed a
    device; then more (data parallel) while the run would outlast `within_s`."""
    usable = usable_memory(d)
    room = usable - (need - state_bytes)
    recompute = ""
    if room <= 0 and least_unsharded is not None and least_unsharded < usable:
        room, need, flops = usable - least_unsharded, state_bytes + least_unsharded, flops * 4 / 3
        recompute = "full activation checkpointing (4/3 the FLOPs), "
    if need <= usable:
        count, why = 1, f"one holds the run ({_gib(need)} of {_gib(usable)})"
    elif room <= 0:
        return TrainingOption(d.kind, 0, math.inf, -1, False, False, d.available,
                              f"activations alone exceed one device ({_gib(need - state_bytes)} of {_gib(usable)})")
    else:
        count = max(2, math.ceil(state_bytes / room))
        why = f"{count} shard the {_gib(state_bytes)} of weights, gradients and optimizer state (FSDP)"
    why = recompute + why
    if count > MAX_DEVICES:
        return TrainingOption(d.kind, count, math.inf, -1, False, False, d.available, why + f", over {MAX_DEVICES}")
    one = training_seconds(d, flops, utilisation, count, micro_steps)
    if one > within_s:
        wanted = min(MAX_DEVICES, math.ceil(count * one / within_s))
        why += f"; {wanted} (data parallel) to finish within {within_s / 3600:g} h"
        count = wanted
    count = _round_to_node(count)
    seconds = training_seconds(d, flops, utilisation, count, micro_steps)
    return TrainingOption(d.kind, count, seconds, _cost(price, count, seconds, d, costs), True,
                          seconds <= within_s, d.available, why)


def choose_training(options: list[TrainingOption]) -> tuple[TrainingOption, str]:
    """The cheapest kind buyers can get that holds the run and finishes within the time; else the cheapest
    scarce one that does; else the fastest that holds it (available kinds first). With why, in words."""
    candidates = [o for o in options if o.candidate]
    if not candidates:
        # Nothing holds it as the table counts: the largest kind buyers can get, sharded as far as the state
        # goes; the layout chooser then says what would (activation checkpointing, tensor parallel) or that nothing does.
        d = max((device(o.kind) for o in options if o.available and device(o.kind).gpu), key=usable_memory)
        need = max(o.devices for o in options if o.kind == d.kind) or 2
        return (TrainingOption(d.kind, _round_to_node(need), math.inf, -1, False, False, True,
                               next(o.why for o in options if o.kind == d.kind)),
                "no kind holds the run as the device table counts: the largest, for the layout to judge")
    order = {o.kind: i for i, o in enumerate(options)}
    in_time = [o for o in candidates if o.within_time]
    ready = [o for o in in_time if o.available]
    if ready:
        best = min(ready, key=lambda o: (o.cost, order[o.kind]))
        scarce = [o for o in in_time if not o.available and o.cost < best.cost]
        note = "the cheapest that finishes in time"
        if scarce:
            s = min(scarce, key=lambda o: o.cost)
            note += f" of the kinds buyers can get ({s.kind} would cost less but is scarce)"
        return best, note
    if in_time:
        best = min(in_time, key=lambda o: (o.cost, order[o.kind]))
        return best, "scarce, but no kind buyers can readily get finishes in time"
    best = min(candidates, key=lambda o: (not o.available, o.seconds, o.cost))
    return best, "no kind finishes in time: the fastest"


def training_hardware(
    task: str,
    memory_per_replica: int,
    state_bytes: int,
    training_flops: float,
    utilisation: float,
    threads: int | None,
    *,
    micro_steps: int = 0,
    within_hours: float = DEFAULT_WITHIN_HOURS,
    costs: CostsSpec | None = None,
    on_device: bool = True,
    parameters: int | None = None,
    least_unsharded: int | None = None,
) -> Hardware:
    """Training hardware by need: every kind in the device table, a CPU included, weighed by the devices its
    memory and `within_hours` need and what they would cost (lease start included); the cheapest that
    finishes in time among the kinds buyers can get wins (`choose_training`). The seed's table is a check
    (`seed_training_check`), written into the why.

    `memory_per_replica` is one device's need without sharding (states, activations, evaluation);
    `state_bytes` the part FSDP divides over devices (weights, gradients, optimizer moments); `utilisation`
    the share of a GPU's peak a run reaches (a CPU core's is UTILISATION['cpu_of_matmul_peak']);
    `micro_steps` the forward-backward passes (each at least GPU_TRAIN_STEP_FLOOR_S on a GPU); `on_device`
    False for a family whose library trains on the host (trees, the linear model): only a CPU is a candidate;
    `least_unsharded` what a device holds besides the state with every block recomputed (full activation
    checkpointing, at 4/3 the FLOPs), for a kind the stage's own activations do not fit."""
    kind = DATA_KINDS[task]
    within_s = within_hours * 3600
    options = training_options(memory_per_replica, state_bytes, training_flops, utilisation, threads,
                               micro_steps=micro_steps, within_s=within_s, costs=costs, on_device=on_device,
                               least_unsharded=least_unsharded)
    best, note = choose_training(options)
    currency = (costs or CostsSpec()).currency
    if best.cost < 0:
        why = f"{best.why}: {note}"
    else:
        why = (f"{best.why}; {_duration(best.seconds)} at "
               f"{(utilisation if device(best.kind).gpu else UTILISATION['cpu_of_matmul_peak']):.0%} of its peak, "
               f"{format_money(best.cost, currency)} with the lease's start: {note} (within {within_hours:g} h)")
    others = sorted((o for o in options if o.candidate and o.kind != best.kind), key=lambda o: o.cost)[:3]
    if others:
        why += "; next: " + ", ".join(f"{describe_devices(o.kind, o.devices)} {format_money(o.cost, currency)}"
                                      + ("" if o.within_time else " (too slow)") + ("" if o.available else " (scarce)")
                                      for o in others)
    check = seed_training_check(kind, best, options, parameters)
    if check:
        why += f"; check against the seed's table: {check}"
    return Hardware(best.kind, best.devices, why, _interconnect(best.devices) if device(best.kind).gpu
                    else Interconnect.ETHERNET.value, tuple(o.to_dict() for o in options), check)


def seed_training_check(data_kind: str, best: TrainingOption, options: list[TrainingOption],
                        parameters: int | None = None) -> str:
    """What the seed's table (tables on CPU, images on a GPU, language models on high-memory GPUs) and its sizes
    (small models on a CPU or one GPU, 7B on a few, 70B on many) would train on, against the choice: empty
    where they agree."""
    on_cpu = not device(best.kind).gpu
    gpus = [o for o in options if o.candidate and device(o.kind).gpu]
    cheapest_gpu = min(gpus, key=lambda o: o.cost) if gpus else None
    out = []
    if data_kind == "tabular" and not on_cpu:
        out.append(f"the table says CPU for a tabular model; {describe_devices(best.kind, best.devices)} is cheaper")
    if data_kind in ("image", "text") and on_cpu and cheapest_gpu is not None:
        out.append(f"the table says GPUs for {'images' if data_kind == 'image' else 'a language model'}; "
                   f"{describe_devices(best.kind, best.devices)} finish in {_duration(best.seconds)} for less than "
                   f"{describe_devices(cheapest_gpu.kind, cheapest_gpu.devices)} ({best.cost:,} against "
                   f"{cheapest_gpu.cost:,} minor units)")
    if data_kind == "text" and not on_cpu and device(best.kind).memory_bytes < HIGH_MEMORY_BYTES:
        out.append(f"the table says high-memory GPUs for a language model; a {best.kind} "
                   f"({_gib(device(best.kind).memory_bytes)}) holds it for less")
    if parameters:
        expected = next(e for most, e in SIZE_INTUITION if parameters <= most)
        got = "cpu" if on_cpu else ("one" if best.devices == 1 else "node" if best.devices <= DEVICES_PER_NODE else "many")
        allowed = {"small": {"cpu", "one"}, "medium": {"one", "node"}, "large": {"node", "many"}, "huge": {"many"}}
        if got not in allowed[expected]:
            out.append(f"a {parameters / 1e9:.3g}B-parameter model is {SIZE_WORDS[expected]} by the seed's sizes; "
                       f"this run's FLOPs and memory call for {describe_devices(best.kind, best.devices)}")
    return "; ".join(out)


def _round_to_node(count: int) -> int:
    if count <= DEVICES_PER_NODE:
        return count
    return math.ceil(count / DEVICES_PER_NODE) * DEVICES_PER_NODE


def _interconnect(count: int) -> str:
    if count <= 1:
        return Interconnect.ETHERNET.value
    if count <= DEVICES_PER_NODE:
        return Interconnect.NVLINK.value
    return Interconnect.INFINIBAND.value


def _duration(seconds: float) -> str:
    if seconds < 1:
        return "under 1 s"  # a tiny model: "~0 s" would read as no work at all
    if seconds < 120:
        return f"~{seconds:.0f} s"
    if seconds < 7200:
        return f"~{seconds / 60:.0f} min"
    return f"~{seconds / 3600:.1f} h"


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.1f} GiB"

