"""An async save's staging that copies only what the training loop would change before it is written.

A data-parallel rank's parameters and optimizer state change only in the optimizer's step, and the loop's
next step does its forward and backward first. So the writer writes them straight from the live tensors,
and the copies wait for the optimizer: when its next step begins (`release`, an optimizer step pre-hook),
the tensors the writer has not reached yet are copied into buffers (allocated once, refilled by later
saves) and the writer goes on from the copies; a tensor it is writing at that moment is waited for. A write
that ends within the next forward and backward copies nothing, and the loop stalls only for the copies it
still needs. Everything else in the state (module buffers, which a forward may change, such as batch norm's
running statistics; parameters the optimizer does not hold; non-tensor values) is copied when the save is
called.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import torch


class DeferredCopies:
    """One rank's staging for its async saves (one save in flight at a time: the caller waits for the
    previous save before staging the next)."""

    def __init__(self):
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}  # reused across saves, keyed by part and name
        self._cond = threading.Condition()
        self._live: dict[int, tuple[tuple[str, str], torch.Tensor]] = {}  # not yet taken by the writer
        self._copies: dict[int, torch.Tensor] = {}  # copied at release, in place of the live tensor
        self._writing: set[int] = set()  # live tensors the writer is writing now
        self._hook: Any = None
        self.stalled_s = 0.0  # how long the last release held the optimizer's step

    def stage(self, state_dict: dict[str, dict[str, Any]], optimizer: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
        """The state dict to write: parameters and optimizer state as they are (until `release`), the rest
        copied now. Hooks `release` to the optimizer's next step."""
        self._retire_hook()
        # What the optimizer steps: its parameters and their state. A parameter it does not hold (frozen, or
        # changed by other code) is copied now, like the module's buffers.
        changed_by_step = {p.untyped_storage().data_ptr() for g in optimizer.param_groups for p in g["params"]}
        changed_by_step |= {v.untyped_storage().data_ptr() for s in optimizer.state.values() for v in s.values()
                            if isinstance(v, torch.Tensor)}
        staged: dict[str, dict[str, Any]] = {}
        live: dict[int, tuple[tuple[str, str], torch.Tensor]] = {}
        for part, sd in state_dict.items():
            staged[part] = {}
            for key, value in sd.items():
                if not isinstance(value, torch.Tensor):
                    staged[part][key] = copy.deepcopy(value)
                elif value.untyped_storage().data_ptr() in changed_by_step:
                    staged[part][key] = value
                    live[id(value)] = ((part, key), value)
                else:
                    staged[part][key] = self._copy((part, key), value)
        with self._cond:
            self._live, self._copies, self._writing = live, {}, set()
        self.stalled_s = 0.0
        self._hook = optimizer.register_step_pre_hook(lambda *_: self.release())
        return staged

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """The writer's view of `tensor` (the live one, or its copy from `release`). `done(tensor)` must
        follow once it is written."""
        with self._cond:
            if self._live.pop(id(tensor), None) is not None:
                self._writing.add(id(tensor))
                return tensor
            return self._copies.get(id(tensor), tensor)

    def done(self, tensor: torch.Tensor) -> None:
        with self._cond:
            self._writing.discard(id(tensor))
            self._cond.notify_all()

    def release(self) -> None:
        """Make the live tensors free to change: copy those the writer has not taken, wait for those it
        is writing. Called by the optimizer's next step; later calls do nothing."""
        t0 = time.perf_counter()
        with self._cond:
            if not (self._live or self._writing):
                return
            for ident, (name, live) in self._live.items():
                self._copies[ident] = self._copy(name, live)
            self._live = {}
            self._cond.wait_for(lambda: not self._writing)
        self.stalled_s = time.perf_counter() - t0

    def _copy(self, name: tuple[str, str], value: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if buf is None or buf.shape != value.shape or buf.dtype != value.dtype:
            buf = self._buffers[name] = torch.empty(value.shape, dtype=value.dtype)
        return buf.copy_(value.detach())

    def _retire_hook(self) -> None:
        # Removed here, on the loop's thread, not from the hook itself: the optimizer iterates its hooks
        # while calling them.
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
