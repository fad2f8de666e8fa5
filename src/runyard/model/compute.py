"""How a model computes on a device, the same for the training loop and the planner's calibration: the
device `resources.device` names, autocast for the run's precision, the loss every token and label target
shares (cross-entropy summed over positions not marked IGNORE_INDEX) and one micro-batch's forward and
backward pass."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from runyard.data.samples import IGNORE_INDEX
from runyard.errors import RunyardError


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RunyardError("resources.device is 'cuda' but torch sees no CUDA device on this machine")
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(requested)


def autocast_for(device: torch.device, precision: str):
    """bf16 autocast on CUDA when asked (or 'auto'); fp32 everywhere else."""
    if device.type == "cuda" and precision in ("bf16", "auto"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over every position whose label is not IGNORE_INDEX (fp32).
    logits [B, T, V] with labels [B, T] (tokens), or [B, C] with [B] (one label per image)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def forward_backward(
    module: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loss_scale: float, device: torch.device, precision: str
) -> torch.Tensor:
    """One micro-batch: the loss summed over its targets (tokens, or one label per image) times
    `loss_scale` (1 / targets in the whole accumulated batch), so gradients accumulated over micro-batches
    equal one large batch's."""
    with autocast_for(device, precision):
        logits = module(x)
    loss = token_loss_sum(logits, y) * loss_scale
    loss.backward()
    return loss.detach()
