"""The device table: what each accelerator kind a requirement may name computes, holds, draws and costs.

Kinds are the market's (`runyard.market.requirement.ACCELERATOR_KINDS`), so a plan's requirement and its
figures speak of the same devices. Figures are the vendors' data sheets (dense, no sparsity): peak bf16
tensor FLOP/s, memory and its bandwidth, and board power (TDP), which the plan takes as the draw under
load. Prices are list on-demand rates of public GPU clouds in 2025, in US cents per device-hour (AWS,
GCP, Lambda, RunPod; the lowest common list price of each kind); `costs.prices` in a spec overrides them.

`available` says whether buyers can realistically rent the kind on demand (stated, 2025): B200 and MI300X are
listed by few clouds and mostly sold as reserved capacity, so their list price is not a price a buyer can
count on paying today. The training choice (recommend.py) takes a scarce kind only when no available kind
finishes the run within its time; serving, where capacity is held for months, treats every kind alike.

`cpu` is one CPU core: its peak is measured on the machine at hand when the plan calibrates
(`calibrate.cpu_matmul_flops`); the table's figure is a stated fallback (one AVX2 core, fp32 FMA).

Expected utilisation (the fraction of peak a run really reaches) is stated per kind of work in
`UTILISATION`: plans multiply peak by it when they cannot measure.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from runyard.errors import RunyardError
from runyard.market.requirement import ACCELERATOR_KINDS, Interconnect

GIB = 1 << 30


class UnknownDevice(RunyardError):
    """A plan was asked about an accelerator kind the device table does not have."""


@dataclass(frozen=True)
class Device:
    """One device of a kind. `peak_flops` is dense bf16 on accelerators and fp32 on a CPU core."""

    kind: str
    peak_flops: float  # FLOP/s
    memory_bytes: int
    bandwidth_bytes_s: float  # memory bandwidth
    power_w: float  # board power (TDP), taken as the draw under load
    price_per_hour: int  # US cents per device-hour, on demand
    gpu: bool = True
    cuda_names: tuple[str, ...] = ()  # substrings of torch.cuda.get_device_name that mean this kind
    nvlink: bool = False  # NVLink-class links between the devices of a node (SXM/OAM boards; PCIe cards have none)
    available: bool = True  # rentable on demand by most buyers (False: scarce, see the module doc)


DEVICES: dict[str, Device] = {
    d.kind: d
    for d in (
        # One core of a current x86 server: 2 AVX2 FMA units x 8 fp32 lanes x 2 FLOPs x ~3 GHz = 96
        # GFLOP/s; ~10 W a core (a 32-core 300 W part) and 4 GiB of memory; 4.5 cents per vCPU-hour.
        Device("cpu", 96e9, 4 * GIB, 10e9, 10.0, 4, gpu=False),
        Device("t4", 65e12, 16 * GIB, 320e9, 70.0, 35, cuda_names=("T4",)),
        Device("l4", 121e12, 24 * GIB, 300e9, 72.0, 80, cuda_names=("L4",)),
        Device("a10g", 70e12, 24 * GIB, 600e9, 300.0, 101, cuda_names=("A10G",)),
        Device("l40s", 362e12, 48 * GIB, 864e9, 350.0, 149, cuda_names=("L40S",)),
        Device("a100-40gb", 312e12, 40 * GIB, 1555e9, 400.0, 129, cuda_names=("A100-SXM4-40GB", "A100-PCIE-40GB"), nvlink=True),
        Device("a100-80gb", 312e12, 80 * GIB, 2039e9, 400.0, 179, cuda_names=("A100",), nvlink=True),
        Device("h100-80gb", 989e12, 80 * GIB, 3350e9, 700.0, 299, cuda_names=("H100",), nvlink=True),
        Device("h200-141gb", 989e12, 141 * GIB, 4800e9, 700.0, 359, cuda_names=("H200",), nvlink=True),
        Device("b200-192gb", 2250e12, 192 * GIB, 8000e9, 1000.0, 599, cuda_names=("B200",), nvlink=True,
               available=False),
        Device("mi300x", 1307e12, 192 * GIB, 5300e9, 750.0, 249, cuda_names=("MI300X",), nvlink=True,
               available=False),
    )
}
assert set(DEVICES) == set(ACCELERATOR_KINDS), "the device table and the market's kinds must agree"

# Fraction of peak a run reaches, by the work it does (stated, not measured; a calibration replaces it
# on the machine at hand). Decoder training in bf16 on one node reaches 35-50% MFU in torchtitan's and
# Megatron's published runs; small convolutional networks far less (memory-bound layers).
UTILISATION = {
    "train_transformer": 0.35,
    "train_other": 0.20,
    "cpu_of_matmul_peak": 0.5,  # a model's training step against the core's measured matmul rate
    "decode_bandwidth": 0.6,  # serving: weight and KV reads against memory bandwidth
    "decode_compute": 0.35,  # serving: large decode batches against peak FLOP/s
}

DEVICES_PER_NODE = 8  # a GPU training node as clouds sell it (HGX/OAM boards hold 8)

# Memory a device cannot give to the model: the CUDA context and the allocator's reserve (GPU), stated.
GPU_RESERVED_BYTES = GIB // 2
GPU_USABLE_FRACTION = 0.9


def device(kind: str) -> Device:
    """The table's entry for `kind`; UnknownDevice naming the kinds there are."""
    try:
        return DEVICES[kind]
    except KeyError:
        raise UnknownDevice(f"no accelerator kind {kind!r} in the device table; known kinds: {list(DEVICES)}") from None


def kind_of_cuda_name(name: str) -> str | None:
    """The kind whose CUDA names match `name` (torch.cuda.get_device_name), longest match first, or None."""
    best, best_len = None, 0
    for d in DEVICES.values():
        for pattern in d.cuda_names:
            if pattern.lower() in name.lower() and len(pattern) > best_len:
                best, best_len = d.kind, len(pattern)
    return best


def usable_memory(d: Device) -> int:
    """Bytes a training or serving process can use on one device of this kind."""
    if not d.gpu:
        return d.memory_bytes
    return int(d.memory_bytes * GPU_USABLE_FRACTION) - GPU_RESERVED_BYTES


@dataclass(frozen=True)
class Cluster:
    """Devices of one kind on `nodes` nodes of `devices_per_node` each, and the links between them: NVLink-class
    within a node where the kind's boards have it (else PCIe), and across nodes the InfiniBand (or RoCE) that
    multi-node training clusters are sold with (stated)."""

    kind: str
    devices_per_node: int
    nodes: int = 1

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    @property
    def within_node(self) -> str:
        return Interconnect.NVLINK.value if device(self.kind).nvlink else "pcie"

    @property
    def across_nodes(self) -> str | None:
        return Interconnect.INFINIBAND.value if self.nodes > 1 else None

    def describe(self) -> str:
        d = device(self.kind)
        what = "CPU process" if not d.gpu else self.kind
        links = f"{self.within_node} within a node" + (f", {self.across_nodes} across nodes" if self.nodes > 1 else "")
        if self.nodes > 1:
            return f"{self.nodes} nodes x {self.devices_per_node} x {what} ({links})"
        return f"{self.devices_per_node} x {what}" + (f" ({links})" if self.devices > 1 else "")


def cluster_of(kind: str, devices: int) -> Cluster:
    """`devices` of `kind` on as few nodes of at most DEVICES_PER_NODE (GPUs) as hold them, the same number on
    each (12 -> 2 x 6; a count that does not divide rounds up: 17 -> 3 x 6); CPU processes share one node."""
    if not device(kind).gpu or devices <= DEVICES_PER_NODE:
        return Cluster(kind, devices, 1)
    nodes = math.ceil(devices / DEVICES_PER_NODE)
    return Cluster(kind, math.ceil(devices / nodes), nodes)
