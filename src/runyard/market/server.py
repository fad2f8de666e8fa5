"""Running the market: `serve` (what `runyard market serve` calls) and `ServerThread`, a real
uvicorn server on a loopback port inside this process, for tests and benchmarks.

A background thread runs the sweep (deadlines, window ends, settlement) every `sweep_interval_s`.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import uvicorn

from runyard.market import deadlines, identity
from runyard.market.api import DEFAULT_MAX_BODY, create_app
from runyard.market.service import Market
from runyard.system.files import atomic_write_text
from runyard.system.http_thread import AppThread

log = logging.getLogger("runyard.market.server")


class Sweeper(threading.Thread):
    """Runs `deadlines.sweep` every `interval` seconds until stopped."""

    def __init__(self, market: Market, interval: float):
        super().__init__(name="market-sweeper", daemon=True)
        self.market, self.interval = market, interval
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(self.interval):
            try:
                deadlines.sweep(self.market)
            except Exception:  # a failed sweep is retried next time; it never takes the server down
                log.exception("sweep failed")

    def stop(self) -> None:
        self._stop_event.set()


def write_operator_token(market: Market, path: Path, name: str = "operator") -> str | None:
    """Create an operator account and write its token to `path` (mode 0600) unless the file exists."""
    if path.exists():
        return None
    token = identity.create_operator(market, name)["token"]
    atomic_write_text(path, token + "\n", mode=0o600)
    return token


def serve(
    market: Market,
    host: str = "127.0.0.1",
    port: int = 8470,
    sweep_interval_s: float = 5.0,
    max_body_bytes: int = DEFAULT_MAX_BODY,
) -> None:
    """Serve `market` over HTTP until interrupted."""
    sweeper = Sweeper(market, sweep_interval_s) if sweep_interval_s > 0 else None
    if sweeper:
        sweeper.start()
    try:
        config = uvicorn.Config(
            create_app(market, max_body_bytes), host=host, port=port, log_level="warning", access_log=False
        )
        uvicorn.Server(config).run()
    finally:
        if sweeper:
            sweeper.stop()


class ServerThread(AppThread):
    """A real HTTP server for `market` on a free loopback port, in a background thread.

    with ServerThread(market) as server:
        client = MarketClient(server.url)
    """

    def __init__(
        self, market: Market, host: str = "127.0.0.1", port: int | None = None, sweep_interval_s: float = 0
    ):
        super().__init__(create_app(market), host=host, port=port, name="market-http")
        self.market = market
        self.sweeper = Sweeper(market, sweep_interval_s) if sweep_interval_s > 0 else None

    def __enter__(self) -> ServerThread:
        super().__enter__()
        if self.sweeper:
            self.sweeper.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.sweeper:
            self.sweeper.stop()
        super().__exit__(*exc)
