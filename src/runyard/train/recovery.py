"""Recovery figures: what an interruption cost a run, recorded in `run_dir/recovery.json`.

When a stage starts again after an interruption (torchrun restarted its workers, `runyard resume`, the
control plane's retry), from a checkpoint or, when the interruption came before the first one, from
step 0, the tracker notes the last step the metrics log reached before the interruption and, once the first
resumed step completes, writes one event:

- `steps_lost`: steps done before the interruption that must be recomputed (last logged step minus
  the checkpoint's step);
- `seconds_to_first_resumed_step`: wall time from the last step completed before the failure to the
  first step completed after it (an upper bound on failure-to-recovery by at most one step's time);
- `seconds_from_process_start`: the same, counted from this worker process's start (restart cost alone);
- `kind`: "restart" (torchrun restarted the workers) or "resume" (a new session).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from runyard.system.files import atomic_write_text

RECOVERY_FILE = "recovery.json"
_PROCESS_START = time.time()


def read_recovery(run_dir: Path) -> list[dict]:
    path = run_dir / RECOVERY_FILE
    if not path.is_file():
        return []
    try:
        return json.loads(path.read_text()).get("events", [])
    except json.JSONDecodeError:
        return []


def append_event(run_dir: Path, event: dict) -> None:
    """Add one event atomically (temp file, fsync, rename)."""
    events = read_recovery(run_dir) + [event]
    atomic_write_text(run_dir / RECOVERY_FILE, json.dumps({"events": events}, indent=1))


class RecoveryTracker:
    """Used by the training loop on rank 0: `on_resume` before the metrics log is truncated,
    `after_step` after each step (it records once, after the first resumed step)."""

    def __init__(self, run_dir: Path, stage: str, enabled: bool):
        self.run_dir, self.stage, self.enabled = run_dir, stage, enabled
        self.event: dict | None = None

    def on_resume(self, rows: list[dict], resumed_step: int, world_size: int) -> None:
        """Called at every start of the stage with its metrics log as found; a first start (no step
        logged, no checkpoint) records nothing."""
        if not self.enabled or (not rows and resumed_step == 0):
            return
        last = rows[-1] if rows else {}
        last_step = int(last.get("step", resumed_step))
        elastic = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self.event = {
            "stage": self.stage,
            "kind": "restart" if elastic > 0 else "resume",
            "restart_count": int(os.environ.get("RUNYARD_RESTART_COUNT", "0")),
            "world_size": world_size,
            "last_step_before_interruption": last_step,
            "resumed_from_step": resumed_step,
            "steps_lost": max(0, last_step - resumed_step),
            "_last_time": last.get("time"),
        }

    def after_step(self, step: int) -> None:
        if self.event is None:
            return
        now = time.time()
        event, self.event = self.event, None
        last_time = event.pop("_last_time")
        event["first_resumed_step"] = step
        event["seconds_to_first_resumed_step"] = None if last_time is None else round(now - last_time, 3)
        event["seconds_from_process_start"] = round(now - _PROCESS_START, 3)
        event["recorded_at"] = now
        append_event(self.run_dir, event)
