"""The mirror: reads the run directory and forwards what is new to each tracker.

The run directory is the source of truth and the run never waits on a tracker. The mirror runs in a process
of its own (runyard.tracking.process), so its imports (MLflow, SQLAlchemy) and its sends never take the
training process's CPU or GIL: it reads metrics.jsonl, gates.json and the reports as they are written (every
`tracking.interval_s`), and when the run's session ends it sends the evaluation and the export, then closes
the tracked run. A tracker that fails (a server down, a store refusing) is tried again with backoff (1 s
doubling to 60 s); what could not be sent is reported as a warning, never as the run's failure. What each
tracker has been sent is kept in RUN_DIR/tracking/state.json (with MLflow's run id), so a resume continues
the same tracked run and sends only what it has not sent.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path

from runyard.spec.job import JobSpec
from runyard.system.files import atomic_write_json
from runyard.tracking.reader import RunReader, Unit
from runyard.tracking.sinks import TRACKING_DIR, MLflowSink, TensorBoardSink

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
MAX_BACKOFF_S = 60.0


class _Tracker:
    """One sink with its reader, its record of what it was sent, and its retry clock."""

    def __init__(self, sink, reader: RunReader, state: dict):
        self.sink, self.reader, self.state = sink, reader, state
        self.failures, self.next_try, self.error = 0, 0.0, None


class Mirror:
    def __init__(self, spec: JobSpec, run_dir: Path):
        self.spec, self.run_dir = spec, run_dir
        self.state_path = run_dir / TRACKING_DIR / STATE_FILE
        self.state = _read_state(self.state_path)
        self.trackers = []
        tracking = spec.tracking
        for enabled, sink_class in ((tracking.mlflow is not None, MLflowSink), (tracking.tensorboard, TensorBoardSink)):
            if enabled:
                state = self.state.setdefault(sink_class.name, {})
                self.trackers.append(_Tracker(sink_class(spec, run_dir, state), RunReader(spec, run_dir), state))

    def finish(self, status: str) -> list[str]:
        """Send what is left (the evaluation and the export too), end the tracked runs with `status`, and
        return the problems (a tracker that could not send, or could not be closed)."""
        self.sync(final=True)
        problems = []
        for t in self.trackers:
            if t.error is not None:
                problems.append(
                    f"tracking: {t.sink.where()} failed {t.failures} time(s), last: {t.error}. Nothing is lost: the "
                    "run directory holds every figure, and the next `runyard resume` of this run sends what was "
                    "not sent")
                continue
            try:
                t.sink.close(status)
            except Exception as exc:  # a tracker's failure is reported, never the run's
                problems.append(f"tracking: closing {t.sink.where()}: {type(exc).__name__}: {exc}")
        return problems

    def sync(self, final: bool) -> None:
        """One pass: every tracker due a try is sent each unit it has not had (the end of the session adds
        the evaluation and the export, and tries every tracker once more whatever its backoff)."""
        for t in self.trackers:
            if not final and time.monotonic() < t.next_try:
                continue
            try:
                t.sink.open()
                for unit in self._units(t, final):
                    t.sink.send(unit)
                    self._sent(t, unit)
                t.failures, t.error = 0, None
            except Exception as exc:  # a tracker's failure never reaches the run: retried, then reported
                t.failures += 1
                t.error = f"{type(exc).__name__}: {str(exc)[:300]}"
                t.next_try = time.monotonic() + min(MAX_BACKOFF_S, 2.0 ** (t.failures - 1))
                log.debug("tracking: %s: %s (try %d)", t.sink.where(), t.error, t.failures)

    def _units(self, t: _Tracker, final: bool) -> Iterator[Unit]:
        sent = t.state.setdefault("sent", {})
        reader = t.reader
        stages = [s.name for s in self.spec.stages]
        candidates = [reader.spec_unit, reader.data_unit]
        for unit in (c() for c in candidates):
            if unit is not None and sent.get(unit.name) != unit.version:
                yield unit
        for stage in stages:
            unit = reader.metrics_unit(stage, int(sent.get(f"metrics:{stage}", 0)))
            if unit is not None:
                yield unit
            unit = reader.gates_unit(stage)
            if unit is not None and sent.get(unit.name) != unit.version:
                yield unit
        if final:
            for unit in (reader.eval_unit(), reader.export_unit()):
                if unit is not None and sent.get(unit.name) != unit.version:
                    yield unit

    def _sent(self, t: _Tracker, unit: Unit) -> None:
        sent = t.state.setdefault("sent", {})
        if unit.last_step is not None:
            stage = unit.name.removeprefix("metrics:")
            sent[unit.name] = unit.last_step
            t.reader.taken(stage, unit.last_step)
        else:
            sent[unit.name] = unit.version
        atomic_write_json(self.state_path, self.state)


def _read_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def tracked_run_id(run_dir: Path) -> str | None:
    """The MLflow run a run directory is mirrored into, if any."""
    return (_read_state(run_dir / TRACKING_DIR / STATE_FILE).get("mlflow") or {}).get("run_id")
