"""What a step does when its loss or gradient norm is not finite (`train.nonfinite`): stop the stage before
the optimizer step (the default), or skip the step within a budget (`skip_step`).

`stop` guards with `torch._assert_async`: on a GPU the check is queued on the device and never waits for
it (a failed check is a device-side assert, after which no further kernel runs, so that optimizer step
never lands, and the next readback, at the log, fails: `device_assert_as_nonfinite` reports it as
`NonFiniteLoss` naming the steps since the last log, before any checkpoint of them); on a CPU it raises
at once, and the loop reports it as `NonFiniteLoss` naming the step.
`skip_step` must decide on the host whether to step, so it reads one flag back per step. Every rank
decides alike: the gradient norm is already global (DDP and FSDP reduce gradients before it), and under
several processes the flag is reduced so a rank's own non-finite loss stops or skips every rank.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from runyard.errors import EXIT_NON_FINITE, RunyardError
from runyard.train import parallel


class NonFiniteLoss(RunyardError):
    """A stage's loss or gradient norm was NaN or infinite; it stopped before that step's optimizer step."""

    exit_code = EXIT_NON_FINITE


class NonFiniteGuard:
    def __init__(self, stage: str, mode: str, budget: int, skipped: int = 0):
        self.stage, self.mode, self.budget, self.skipped = stage, mode, budget, skipped

    def _message(self, step: int, why: str = "") -> str:
        return (f"stage {self.stage}: the loss or gradient norm is not finite at step {step}; stopped before its "
                f"optimizer step{why} (the latest checkpoint is from an earlier step). Lower optim.lr, set "
                f"optim.grad_clip, or set train.nonfinite: skip_step with a train.nonfinite_budget")

    def should_step(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, ctx: parallel.DistContext) -> bool:
        """Whether step `step` (1-based) takes its optimizer step; NonFiniteLoss when the stage stops."""
        finite = torch.isfinite(loss) & torch.isfinite(grad_norm)
        if ctx.distributed:  # every rank takes the same decision (queued on the device under nccl)
            flag = finite.to(torch.float32).reshape(1)
            if ctx.device.type != "cuda":
                flag = flag.cpu()
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            finite = flag[0] > 0.5
        if self.mode == "stop":
            try:
                torch._assert_async(finite, self._message(step))
            except RuntimeError as exc:  # a CPU: raised at once, before the optimizer step
                raise NonFiniteLoss(self._message(step)) from exc
            return True
        if bool(finite):  # skip_step: the one readback it costs per step
            return True
        self.skipped += 1
        if self.skipped > self.budget:
            raise NonFiniteLoss(self._message(step, f", {self.skipped} non-finite steps exceed "
                                                    f"train.nonfinite_budget {self.budget}"))
        return False


@contextlib.contextmanager
def device_assert_as_nonfinite(stage: str, first_step: int, last_step: int):
    """Around the log's readback on a GPU: the device-side assert of a failed `stop` guard in steps
    first_step..last_step surfaces here, and is reported as the NonFiniteLoss it is."""
    try:
        yield
    except RuntimeError as exc:
        if "device-side assert" not in str(exc):
            raise
        raise NonFiniteLoss(
            f"stage {stage}: the loss or gradient norm is not finite at a step in {first_step}..{last_step} (a "
            f"device-side assert; the device's context is lost); stopped before that step's optimizer step, and "
            f"no checkpoint of those steps was written") from exc
