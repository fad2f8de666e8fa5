"""Training metrics: the metrics.jsonl log and model FLOPs utilisation against known device peaks."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from runyard.system.files import atomic_write_text

# Dense (no sparsity) bf16 tensor-core peaks in FLOP/s, from the vendors' data sheets. A device not in
# this table gets no MFU figure rather than a guessed one.
DENSE_BF16_PEAK_FLOPS = {
    "H200": 989e12,
    "H100 SXM": 989e12,
    "H100 80GB HBM3": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "A100": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "RTX 4090": 165e12,
}


def device_peak_flops(device: torch.device) -> float | None:
    """The dense bf16 peak of `device`, or None when it is not a known accelerator (e.g. a CPU)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    # Longest key first so "H100 PCIe" wins over a shorter match.
    for key in sorted(DENSE_BF16_PEAK_FLOPS, key=len, reverse=True):
        if key.lower() in name.lower():
            return DENSE_BF16_PEAK_FLOPS[key]
    return None


def mfu(flops_per_token: float, tokens_per_s: float, peak_flops: float | None, n_devices: int = 1) -> float | None:
    if not peak_flops or not math.isfinite(tokens_per_s):
        return None
    return flops_per_token * tokens_per_s / (peak_flops * n_devices)


class MetricsLog:
    """Appends one JSON object per line. On resume, lines past the checkpoint's step are dropped so the
    resumed run rewrites them and the log reads exactly as if the run had never stopped."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def truncate_after(self, step: int) -> None:
        if not self.path.exists():
            return
        kept = [row for row in self.read() if row.get("step", -1) <= step]
        atomic_write_text(self.path, "".join(json.dumps(row) + "\n" for row in kept))

    def write(self, row: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        rows = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError:
                        continue  # a line cut by a crash mid-write
        return rows
