"""Which device nodes and /sys entries a lease job's GPUs are, found by the GPUs' identity.

CUDA's index i is not /dev/nvidia{i}: the node's number is the driver's minor number, CUDA's default
order is fastest-first (not PCI bus order), and a Slurm step re-indexes its GPUs from 0. So the
launcher asks the driver: `nvidia-smi --query-gpu=index,uuid,pci.bus_id --format=csv,noheader`
names each GPU (nvidia-smi's index is PCI bus order, the order `runyard control` numbers its
`cuda:i` devices in, see `daemon.detect_inventory`), and /proc/driver/nvidia/gpus/<bus id>/information
gives its "Device Minor", the N of /dev/nvidiaN. An allocated device is an index or a UUID (Slurm
may set either in CUDA_VISIBLE_DEVICES); inside the sandbox CUDA_VISIBLE_DEVICES names the
allocated GPUs by UUID, so CUDA there cannot pick another GPU whatever its order.

The parsing is pure (`parse_query`, `device_minor`, `plan`) so it is tested with recorded outputs;
`find` runs the tool and reads /proc. Without allocated GPUs, or without the NVIDIA driver, nothing is
bound.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from runyard.errors import RunyardError

QUERY = ["nvidia-smi", "--query-gpu=index,uuid,pci.bus_id", "--format=csv,noheader"]
PROC_GPUS = Path("/proc/driver/nvidia/gpus")
# The nodes every GPU process opens, whichever GPUs it has.
# /dev/nvidia-caps holds the capability nodes MIG instances need.
CONTROL_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia-modeset", "/dev/nvidia-caps")
# What the GPU runtime reads of /sys besides each GPU's own PCI device: the driver modules' parameters
# and versions (NVML and the CUDA driver check them).
SYS_MODULES = ("/sys/module/nvidia", "/sys/module/nvidia_uvm", "/sys/module/nvidia_modeset")
_BUS = re.compile(r"^(?:([0-9A-Fa-f]{4,8}):)?([0-9A-Fa-f]{2}):([0-9A-Fa-f]{2})\.([0-7])$")


class GpuMappingError(RunyardError):
    """The allocated GPUs could not be matched with the driver's devices; the message says which."""


@dataclass(frozen=True)
class Gpu:
    index: int  # nvidia-smi's (PCI bus order)
    uuid: str  # GPU-xxxxxxxx-...
    bus_id: str  # normalised: 0000:17:00.0, as /proc/driver/nvidia/gpus and /sys/bus/pci/devices name it


@dataclass
class GpuBinds:
    """What the sandbox shows for its GPUs: device nodes, /sys entries, and CUDA_VISIBLE_DEVICES inside."""

    nodes: list[str] = field(default_factory=list)
    sys_paths: list[str] = field(default_factory=list)
    visible: str = ""  # UUIDs, comma-separated, in the allocation's order


def normalise_bus_id(text: str) -> str:
    """nvidia-smi's `00000000:17:00.0` -> `0000:17:00.0` (the kernel's PCI address form)."""
    match = _BUS.match(text.strip())
    if not match:
        raise GpuMappingError(f"{text.strip()!r} is not a PCI bus id (expected DOMAIN:BUS:DEVICE.FUNCTION)")
    domain, bus, dev, fn = match.groups()
    return f"{(domain or '0')[-4:].zfill(4)}:{bus}:{dev}.{fn}".lower()


def parse_query(text: str) -> list[Gpu]:
    """The GPUs in nvidia-smi's `--query-gpu=index,uuid,pci.bus_id --format=csv,noheader` output."""
    gpus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3 or not parts[0].isdigit() or not parts[1].startswith(("GPU-", "MIG-")):
            raise GpuMappingError(f"nvidia-smi query line {n} {line.strip()[:200]!r}: expected 'index, uuid, pci.bus_id'")
        gpus.append(Gpu(int(parts[0]), parts[1], normalise_bus_id(parts[2])))
    return gpus


def device_minor(information: str) -> int:
    """The 'Device Minor' of /proc/driver/nvidia/gpus/<bus id>/information: /dev/nvidia<minor>."""
    for line in information.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "Device Minor" and value.strip().isdigit():
            return int(value.strip())
    raise GpuMappingError("the driver's GPU information has no 'Device Minor' line")


def plan(allocated: list[str], gpus: list[Gpu], information: Callable[[str], str]) -> GpuBinds:
    """The binds for the `allocated` GPUs (nvidia-smi indices or UUIDs), given the driver's GPUs and
    `information(bus_id)` (the text of its /proc information file)."""
    binds = GpuBinds()
    if not allocated:
        return binds
    by_index = {str(g.index): g for g in gpus}
    by_uuid = {g.uuid: g for g in gpus}
    chosen = []
    for ident in allocated:
        gpu = by_uuid.get(ident) or by_index.get(ident)
        if gpu is None:
            raise GpuMappingError(f"allocated GPU {ident!r} is none of the driver's GPUs "
                                  f"({', '.join(f'{g.index}={g.uuid}' for g in gpus) or 'nvidia-smi lists none'})")
        if gpu not in chosen:
            chosen.append(gpu)
    binds.nodes = [*CONTROL_NODES, *(f"/dev/nvidia{device_minor(information(g.bus_id))}" for g in chosen)]
    binds.sys_paths = [*(f"/sys/bus/pci/devices/{g.bus_id}" for g in chosen), *SYS_MODULES]
    binds.visible = ",".join(g.uuid for g in chosen)
    return binds


def allocated_gpus(devices: list[str]) -> list[str]:
    """The GPU identifiers among an attempt's devices: `cuda:3` -> `3`, `cuda:GPU-...` -> `GPU-...`."""
    return [d.split(":", 1)[1] for d in devices if d.startswith("cuda:") and d.split(":", 1)[1]]


def find(devices: list[str], timeout_s: float = 30.0) -> GpuBinds:
    """The binds for an attempt's GPUs on this machine; empty without GPUs. GpuMappingError when GPUs
    are allocated but the driver cannot say which they are."""
    allocated = allocated_gpus(devices)
    if not allocated:
        return GpuBinds()
    if shutil.which(QUERY[0]) is None:
        if not PROC_GPUS.parent.exists():  # no NVIDIA driver: no GPU node exists to bind (as on a CPU host)
            return GpuBinds()
        raise GpuMappingError(f"GPUs {allocated} are allocated but nvidia-smi is not on PATH to identify them")
    try:
        out = subprocess.run(QUERY, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GpuMappingError(f"nvidia-smi did not run: {exc}") from None
    if out.returncode != 0:
        raise GpuMappingError(f"nvidia-smi failed ({out.returncode}): {(out.stderr or out.stdout).strip()[-300:]}")

    def information(bus_id: str) -> str:
        path = PROC_GPUS / bus_id / "information"
        try:
            return path.read_text()
        except OSError as exc:
            raise GpuMappingError(f"cannot read {path}: {exc}") from None

    return plan(allocated, parse_query(out.stdout), information)
