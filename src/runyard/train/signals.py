"""Graceful stop: SIGTERM or SIGINT asks the loop to checkpoint at the next step boundary and exit."""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


class StopRequest:
    """Set by a signal handler, read by the training loop between steps."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name: str | None = None

    def request(self, name: str) -> None:
        self.signal_name = name
        self._event.set()

    @property
    def requested(self) -> bool:
        return self._event.is_set()


@contextmanager
def stop_on_signals(stop: StopRequest, signals=(signal.SIGTERM, signal.SIGINT)):
    """Route the given signals to `stop` while the block runs (main thread only; a no-op elsewhere)."""
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return
    previous = {}

    def handler(signum, _frame):
        if stop.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C means now
        stop.request(signal.Signals(signum).name)

    for sig in signals:
        previous[sig] = signal.signal(sig, handler)
    try:
        yield stop
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
