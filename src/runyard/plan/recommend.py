"""Recommendations from the data and the model's size: which model family, and which hardware to train
and to serve on.

The family follows the seed material's table; training hardware is sized by the plan's own figures along
it. Serving hardware is not chosen here: every kind, a CPU core included, is a candidate and the cheapest
day at the traffic wins (lifetime.py), with this table as a check. The seed's table:

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
from runyard.plan.devices import DEVICES_PER_NODE, Device, device, usable_memory

# Tasks by the kind of data they read.
DATA_KINDS = {
    "language_model": "text",
    "tabular_classification": "tabular",
    "tabular_regression": "tabular",
    "image_classification": "image",
}

# Training hardware per data kind: the kinds to try, smallest first (the first whose memory holds a
# replica's share, or the last with more devices).
TRAIN_KINDS = {
    "tabular": ("cpu",),
    "image": ("l4", "l40s", "a100-80gb", "h100-80gb"),
    "text": ("h100-80gb", "h200-141gb", "b200-192gb"),
}
DEFAULT_CPU_CORES = 4  # a tabular run's cores when resources.threads leaves it to the machine
TARGET_TRAINING_HOURS = 24.0  # more devices (data parallel) while one run would take longer than this


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


def training_hardware(
    task: str,
    memory_per_replica: int,
    state_bytes: int,
    training_flops: float,
    utilisation: float,
    threads: int | None,
) -> Hardware:
    """Training hardware along the table: a kind whose memory holds the run, as many devices as its
    sharded state needs, and more (data parallel) while the run would take longer than a day.

    `memory_per_replica` is one device's need without sharding (states, activations, evaluation);
    `state_bytes` the part FSDP divides over devices (weights, gradients, optimizer moments)."""
    kind = DATA_KINDS[task]
    if kind == "tabular":
        cores = threads or DEFAULT_CPU_CORES
        return Hardware("cpu", cores, f"tabular data trains on CPU ({cores} cores: resources.threads, or "
                        f"{DEFAULT_CPU_CORES} when it is left to the machine)")
    kinds = TRAIN_KINDS[kind]
    chosen = next((k for k in kinds if memory_per_replica <= usable_memory(device(k))), kinds[-1])
    d = device(chosen)
    unsharded = memory_per_replica - state_bytes
    room = usable_memory(d) - unsharded
    if memory_per_replica <= usable_memory(d):
        count, memory_why = 1, f"one holds the run ({_gib(memory_per_replica)} of {_gib(usable_memory(d))})"
    elif room <= 0:
        count, memory_why = _sharded_count(d, memory_per_replica), "activations alone exceed one device"
    else:
        count = max(2, math.ceil(state_bytes / room))
        memory_why = f"{count} shard the {_gib(state_bytes)} of weights, gradients and optimizer state (FSDP)"
    hours = training_flops / (d.peak_flops * utilisation * count) / 3600
    while hours > TARGET_TRAINING_HOURS and count < 1024:
        count *= 2
        hours /= 2
    count = _round_to_node(count)
    why = (f"{'images train' if kind == 'image' else 'a language model trains'} on GPUs: {chosen}, {memory_why}; "
           f"{_duration(hours * 3600)} at {utilisation:.0%} of its peak")
    if count > 1 and hours <= TARGET_TRAINING_HOURS and not why.endswith("(FSDP)"):
        why += f" (data parallel to stay within {TARGET_TRAINING_HOURS:.0f} h)"
    return Hardware(chosen, count, why, _interconnect(count))


def _sharded_count(d: Device, need: int) -> int:
    return max(2, math.ceil(need / usable_memory(d)))


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

