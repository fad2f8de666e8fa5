"""Prometheus metrics of the model server, through `prometheus_client` (one registry per app, so two
servers in one process do not mix their figures).

Gauges read live state at scrape time (queue depth, running batch, KV slots, drift); histograms record
what clients see: time to first token from the request's arrival, the gap between a sequence's
successive tokens, whole-request latency. Output tokens per second is a gauge over the last
`RATE_WINDOW_S` seconds (Prometheus users can also take rate() of the token counter).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

RATE_WINDOW_S = 10.0
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.queue_depth = Gauge("runyard_queue_depth", "sequences waiting for a KV slot", registry=r)
        self.running = Gauge("runyard_running_batch_size", "sequences in the running decode batch", registry=r)
        self.kv_slots = Gauge("runyard_kv_slots", "KV cache slots (sequences that fit at once)", registry=r)
        self.ttft = Histogram(
            "runyard_time_to_first_token_seconds", "request arrival to its first token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "runyard_inter_token_latency_seconds", "gap between a sequence's successive tokens", buckets=LATENCY_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "runyard_request_duration_seconds", "request arrival to its last token", buckets=LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter("runyard_prompt_tokens", "prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("runyard_generation_tokens", "tokens generated", registry=r)
        self.requests = Counter("runyard_requests", "finished sequences by finish reason", ["finish_reason"], registry=r)
        self.errors = Counter("runyard_request_errors", "requests refused or failed, by HTTP status", ["status"], registry=r)
        self.tokens_per_s = Gauge(
            "runyard_generation_tokens_per_second", f"tokens generated per second over the last {RATE_WINDOW_S:.0f}s", registry=r
        )
        self.tokens_per_s.set_function(self._rate)
        self.drift_js = Gauge("runyard_drift_token_js", "token JS divergence of recent prompts from training", registry=r)
        self.drift_threshold = Gauge(
            "runyard_drift_token_js_threshold", "JS divergence same-size training samples stay under", registry=r
        )
        self.drift_alert = Gauge("runyard_drift_alert", "1 while recent prompts are past the drift threshold", registry=r)
        self.drift_events = Gauge("runyard_drift_events", "sustained drift events recorded since start", registry=r)
        self._lock = threading.Lock()
        self._recent: deque[tuple[float, int]] = deque()

    def watch(self, queue_depth: Callable[[], float], running: Callable[[], float], slots: Callable[[], float]) -> None:
        """Read these gauges from the engine at scrape time."""
        self.queue_depth.set_function(queue_depth)
        self.running.set_function(running)
        self.kv_slots.set_function(slots)

    def tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)
        with self._lock:
            self._recent.append((time.monotonic(), n))

    def _rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
                self._recent.popleft()
            return sum(n for _, n in self._recent) / RATE_WINDOW_S

    def render(self) -> bytes:
        return generate_latest(self.registry)
