"""What the server does with every admitted prompt besides answering it: log it (opt-in, scrubbed),
feed the drift monitor, and act on sustained drift.

Work happens on one background thread, so a request only enqueues its prompt. Every `check_every`
prompts the monitor is judged (each judgement at the monitor's stated false-alarm rate, serve/drift.py);
drift that stays past its threshold on every judgement across
`sustain_requests` prompts is a **drift event**: logged, listed in `/v1/drift`, and, when a
retrainer is configured, answered by one retraining: a job on the control plane (serve/retrain.py) or a
funded demand on the market (serve/retrain_market.py), at most `max_retrains` per server (None: no count,
the market's maintenance budget caps it); later events are recorded but submit nothing. A retraining
refused by policy (too few usable logged records) is recorded as the event's outcome, with the counts,
and is tried again while the event lasts, each time the log has grown by a tenth of the minimum; one
over the maintenance budget is recorded and not tried again. One whose destination cannot be reached is
tried again after the retrainer's backoff (the watcher wakes for it even without traffic), each attempt
on the event; an event while one is still being placed records that and places nothing.
Drift that clears re-arms the event: one drift episode, one retraining.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import asdict
from typing import Any

from runyard.serve.drift import DriftMonitor, DriftReport
from runyard.serve.errors import RetrainDeferred, RetrainError, RetrainOverBudget, RetrainRefused
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain import Retrainer
from runyard.serve.retrain_market import MarketRetrainer

log = logging.getLogger("runyard.serve")

MAX_PENDING = 10_000  # prompts waiting for the watcher; past this they are counted and dropped
BACKLOG_SKIP = 1_000  # prompts waiting past which a due judgement is skipped (judging is the slow part)


def _judgement(report: DriftReport) -> dict[str, Any]:
    """What a report says, as /v1/drift and an event record show it: the worst window's statistic, value,
    threshold and size, every window, and what moved it."""
    worst = report.worst
    return {
        "statistic": "token_js_bits",
        "judged": bool(report.windows),
        "reason": report.reason,
        "token_js": worst.token_js if worst else None,
        "token_js_threshold": worst.token_js_threshold if worst else None,
        "window_requests": worst.requests if worst else None,
        "windows": [asdict(w) for w in report.windows],
        "false_alarm_rate": report.false_alarm_rate,
        "null_draws": report.null_draws,
        "distinct_prompts": report.distinct_prompts,
        "moved_tokens": list(report.moved_tokens),
        "divergent_prompts": list(report.divergent_prompts),
    }


class TrafficWatch:
    def __init__(
        self,
        monitor: DriftMonitor | None = None,
        request_log: RequestLog | None = None,
        retrainer: Retrainer | MarketRetrainer | None = None,
        *,
        check_every: int = 5,
        sustain_requests: int = 20,
        max_retrains: int | None = 1,
    ):
        if check_every < 1 or sustain_requests < 0:
            raise ValueError("check_every must be >= 1 and sustain_requests >= 0")
        self.monitor, self.request_log, self.retrainer = monitor, request_log, retrainer
        self.check_every, self.sustain_requests, self.max_retrains = check_every, sustain_requests, max_retrains
        self.events: list[dict[str, Any]] = []
        self.retrains = 0
        self.dropped = 0
        self._seen = 0
        self._last: DriftReport | None = None
        self._drift_since: int | None = None
        self._in_event = False
        self._retry_at: int | None = None  # logged records at which a refused retraining is tried again
        self._deferred: tuple[dict[str, Any], float] | None = None  # (event, monotonic time) of the next attempt
        self._queue: queue.Queue[tuple[str, list[int]] | None] = queue.Queue(maxsize=MAX_PENDING)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="runyard-watch", daemon=True)
        self._thread.start()

    def observe(self, text: str, prompt_ids: list[int]) -> None:
        """Called on the request path: O(1), never blocks."""
        try:
            self._queue.put_nowait((text, list(prompt_ids)))
        except queue.Full:
            with self._lock:
                self.dropped += 1

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until every prompt observed so far has been handled."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        if self.request_log is not None:
            self.request_log.close()

    def status(self) -> dict[str, Any]:
        """The latest judgement (worst window first), the event rule, and the events so far."""
        with self._lock:
            report, events = self._last, list(self.events)
            out: dict[str, Any] = {
                "requests_seen": self._seen,
                "pending": self._queue.unfinished_tasks,
                "dropped": self.dropped,
                "drifting": bool(report and report.drifting),
                "statistic": "token_js_bits",
                "token_js": None,
                "token_js_threshold": None,
                "window_requests": None,
                "windows": [],
                "judged": False,
                "reason": "no judgement yet",
                "false_alarm_rate": self.monitor.false_alarm_rate if self.monitor else None,
                "warmup_requests": self.monitor.warmup if self.monitor else None,
                "moved_tokens": [],
                "divergent_prompts": [],
                "event_rule": {"check_every": self.check_every, "sustain_requests": self.sustain_requests},
                "drift_since_request": self._drift_since,
                "events": events,
                "logged_requests": self.request_log.records if self.request_log else None,
                "retraining": self.retrainer is not None,
                "retrain_policy": self.retrainer.policy() if self.retrainer else None,
            }
        if report is not None:
            out.update(_judgement(report))
        return out

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self._deferred_wait())
            except queue.Empty:  # no prompt: a deferred retraining is due
                self._retry_deferred()
                continue
            try:
                if item is None:
                    return
                self._handle(*item)
                self._retry_deferred()
            except Exception:  # one bad prompt or a full disk must not stop the watcher
                log.exception("drift watcher failed on a prompt")
            finally:
                self._queue.task_done()

    def _deferred_wait(self) -> float | None:
        """Seconds until a deferred retraining is due (None: none is)."""
        return None if self._deferred is None else max(0.0, self._deferred[1] - time.monotonic())

    def _retry_deferred(self) -> None:
        if self._deferred is not None and time.monotonic() >= self._deferred[1]:
            event, self._deferred = self._deferred[0], None
            try:
                self._submit(event)
            except Exception:
                log.exception("drift watcher failed to retry a retraining")

    def _handle(self, text: str, prompt_ids: list[int]) -> None:
        if self.request_log is not None:
            self.request_log.append(text)
        with self._lock:
            self._seen += 1
            seen = self._seen
        if self.monitor is None:
            return
        self.monitor.observe(prompt_ids, text)
        if seen % self.check_every:
            return
        if self._queue.qsize() >= BACKLOG_SKIP:  # behind: catch up on prompts first, judge at a later check
            return
        report = self.monitor.report()
        event = None
        with self._lock:
            self._last = report
            if not report.drifting:
                self._drift_since, self._in_event = None, False
            else:
                if self._drift_since is None:
                    self._drift_since = seen
                if not self._in_event and seen - self._drift_since >= self.sustain_requests:
                    self._in_event = True
                    event = self._event(report, seen)
                    self.events.append(event)
            retry = (event is None and self._in_event and self._retry_at is not None and self.request_log is not None
                     and self.request_log.records >= self._retry_at)
            if not self._in_event:
                self._retry_at = None
        if event is not None:
            self._act(event)
        elif retry:
            self._submit(self.events[-1])

    def _event(self, report: DriftReport, seen: int) -> dict[str, Any]:
        return {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "requests_seen": seen,
            "drift_since_request": self._drift_since,
            **_judgement(report),
            "retrain": None,
        }

    def _act(self, event: dict[str, Any]) -> None:
        moved = ", ".join(repr(t.get("text", t["token_id"])) for t in event["moved_tokens"][:5])
        log.warning(
            "drift event: recent prompts past the drift threshold since request %s (token JS %s > %s over %s "
            "requests, false-alarm rate %s per judgement); tokens that moved it most: %s",
            event["drift_since_request"], event["token_js"], event["token_js_threshold"], event["window_requests"],
            event["false_alarm_rate"], moved or "none",
        )
        self._submit(event)

    def _submit(self, event: dict[str, Any]) -> None:
        """Submit the event's retraining, or record why not (its outcome in `event["retrain"]`)."""
        if self.retrainer is None or (self.max_retrains is not None and self.retrains >= self.max_retrains):
            return
        if self._deferred is not None and self._deferred[0] is not event:
            with self._lock:
                event["retrain"] = {"submitted": False, "reason": "not placed: the retraining of the event at request "
                                    f"{self._deferred[0]['requests_seen']} is still being placed"}
            return
        retry_at = None
        try:
            result = self.retrainer.submit()
            self.retrains += 1
        except RetrainRefused as exc:  # by policy: not counted against max_retrains, tried again as the log grows
            log.warning("drift: retraining %s", exc)
            result = {"submitted": False, "reason": str(exc), "traffic": exc.traffic}
            retry_at = self.request_log.records + max(1, self.retrainer.min_logged // 10) if self.request_log else None
        except RetrainOverBudget as exc:  # by policy, for this episode: recorded, not tried again
            log.warning("drift: retraining %s", exc)
            result = {"submitted": False, "reason": str(exc), "budget": exc.budget}
        except RetrainDeferred as exc:  # not reached: the same retraining is tried again after its backoff
            result = exc.outcome
            self._deferred = (event, time.monotonic() + exc.retry_in_s)
        except RetrainError as exc:
            self.retrains += 1
            log.error("drift: retraining not submitted: %s", exc)
            result = {**exc.details, "submitted": False, "error": str(exc)}
        with self._lock:
            event["retrain"] = result
            self._retry_at = retry_at
