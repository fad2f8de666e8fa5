"""How a model computes on a device, the same for the training loop and the planner's calibration: the
device `resources.device` names, autocast for the run's precision, the loss every token and label target
shares (cross-entropy summed over positions not marked IGNORE_INDEX), one micro-batch's forward and
backward pass, and activation checkpointing of the units a family names (its blocks): applied from outside
the model, so the loop and the calibration recompute the same blocks and the model never knows."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from runyard.data.samples import IGNORE_INDEX
from runyard.errors import RunyardError

ACTIVATION_CHECKPOINTING = ("none", "full", "selective")


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


def checkpointed_indices(n_units: int, mode: str, every: int = 1) -> list[int]:
    """Which of `n_units` blocks recompute their activations in backward: none, all (`full`), or every
    `every`-th (`selective`: blocks every, 2*every, ... counted from 1, torchtitan's `ac_freq`)."""
    if mode not in ACTIVATION_CHECKPOINTING:
        raise ValueError(f"activation checkpointing {mode!r}: expected one of {ACTIVATION_CHECKPOINTING}")
    if mode == "none":
        return []
    step = 1 if mode == "full" else max(1, every)
    return [i for i in range(n_units) if (i + 1) % step == 0]


class _RecomputedForward:
    """A module's own forward run under `torch.utils.checkpoint` (non-reentrant, RNG state preserved, so
    dropout recomputes the same mask and the loss and gradients are bitwise those without it). Held as
    the instance's `forward`, so parameter names, state dicts and FSDP's hooks around the call do not
    move; it refers to its module through an attribute, so a deep copy of the model refers to the copy."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        forward = type(self.module).forward.__get__(self.module)
        if not torch.is_grad_enabled():  # evaluation and generation keep nothing for backward anyway
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(units: Sequence[torch.nn.Module], mode: str, every: int = 1) -> list[int]:
    """Recompute the activations of the chosen `units` (a family's blocks, `ModelFamily.checkpoint_units`)
    in backward instead of keeping them; returns the indices of the units that recompute."""
    chosen = checkpointed_indices(len(units), mode, every)
    for i in chosen:
        if not isinstance(units[i].__dict__.get("forward"), _RecomputedForward):
            units[i].forward = _RecomputedForward(units[i])
    return chosen


def is_recomputed(module: torch.nn.Module) -> bool:
    """Whether `module`'s activations are recomputed in backward (apply_activation_checkpointing)."""
    return isinstance(module.__dict__.get("forward"), _RecomputedForward)
