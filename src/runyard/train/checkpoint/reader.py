"""Reading a checkpoint outside training (gates, evaluation, export, tests): verify, then load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from runyard.errors import CheckpointCorrupt
from runyard.train.checkpoint import plain, sharded, store
from runyard.train.tensor_parallel import FusedRows


def read_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify the checkpoint at `path`, then load it: (state dicts by part, plain values). The parts
    are `model`, `optimizer` and `rng` for a one-process checkpoint; `model` alone (consolidated from
    its shards) for a sharded one. Raises CheckpointCorrupt."""
    manifest = store.verify_checkpoint(path)
    parts = plain.read_parts(path, manifest, map_location)
    if "model" not in parts and sharded.is_sharded(path):
        parts["model"] = sharded.read_model(path, map_location)
    values = store.read_state_json(path)
    if "model" in parts and values.get("tp_fused_rows"):
        parts["model"] = model_order(parts["model"], values["tp_fused_rows"], int(values["tp"]))
    return parts, values


def model_order(weights: dict[str, torch.Tensor], fused_rows: dict[str, list[int]], tp: int) -> dict[str, torch.Tensor]:
    """Checkpoints written by a tensor-parallel job before they were layout-independent hold fused
    projections' rows rank by rank (train/tensor_parallel.py); whoever reads whole weights gets the
    model's own order."""
    out = dict(weights)
    sharded.MODEL_ORDER.reorder(out, None, stored=FusedRows({k: tuple(v) for k, v in fused_rows.items()}, tp))
    return out


def read_model_weights(path: Path, map_location: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """The model's state dict held by the checkpoint at `path` (verified first), whichever format."""
    parts, _ = read_checkpoint(path, map_location)
    if "model" not in parts:
        raise CheckpointCorrupt(f"checkpoint {path} holds no model weights")
    return parts["model"]
