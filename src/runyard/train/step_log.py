"""The steps the loop has taken since it last logged, kept on the device until it logs.

A step's loss, gradient norm, token count and objective statistics (`step_stats`) are tensors the host
never waits for. At the log interval `read_back` sums what each rank holds alone (its loss, its
statistics, its stop flag) in one all-reduce, and reads everything back in one `.tolist()`: one
collective and one host synchronisation per log, none per step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from runyard.train import parallel


@dataclass
class LoggedStep:
    """One step's figures as the host reads them at the log."""

    step: int
    lr: float
    loss: float  # the global batch's mean loss (this rank's share summed over ranks)
    grad_norm: float
    tokens: float  # input tokens of the step over every process
    stats: list[float]  # the objective's step_stats summed over ranks
    stepped: bool  # False: skipped for a non-finite loss (train.nonfinite: skip_step)
    skipped: int  # steps skipped so far in the stage
    time: float


class PendingSteps:
    def __init__(self, device: torch.device):
        self.device = device
        self._steps: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def first_step(self) -> int:
        return self._steps[0]["step"]

    def add(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor, tokens: Any,
            stats: torch.Tensor, stepped: bool, skipped: int, time: float) -> None:
        """Keep a step's figures (tensors stay where they are; `tokens` may be a host number)."""
        self._steps.append({"step": step, "lr": lr, "loss": loss, "grad_norm": grad_norm, "tokens": tokens,
                            "stats": stats, "stepped": stepped, "skipped": skipped, "time": time})

    def read_back(self, ctx: parallel.DistContext, stop_requested: bool) -> tuple[list[LoggedStep], bool]:
        """The pending steps as the host sees them, and whether any rank asked to stop; clears them."""
        steps, dev = self._steps, self.device
        n, width = len(steps), steps[0]["stats"].numel()
        summed = torch.cat([torch.stack([s["loss"].double() for s in steps]),
                            torch.stack([s["stats"] for s in steps]).reshape(-1),
                            torch.full((1,), float(stop_requested), dtype=torch.float64, device=dev)])
        own = torch.stack([torch.stack([s["grad_norm"].double().reshape(()),
                                        torch.as_tensor(s["tokens"], dtype=torch.float64, device=dev)])
                           for s in steps])
        values = torch.cat([parallel.all_reduce_sum_tensor(summed, ctx), own.reshape(-1)]).tolist()
        stats, stop_votes, own_values = values[n: n + n * width], values[n + n * width], values[n + n * width + 1:]
        # Each data-parallel or tensor-parallel rank holds its share of the loss (scaled by the data world
        # size); under pipeline parallelism only the last stage holds it, the others add 0.
        holders = ctx.world_size // ctx.pp
        logged = [LoggedStep(s["step"], s["lr"], values[i] / holders, own_values[2 * i], own_values[2 * i + 1],
                             stats[i * width: (i + 1) * width], s["stepped"], s["skipped"], s["time"])
                  for i, s in enumerate(steps)]
        self._steps = []
        return logged, stop_votes > 0
