"""A real HTTP server for an ASGI app in a background thread, on loopback.

Used wherever runyard (or its tests and benchmarks) needs a live server inside the current process:
the market's test server, the model server's tests. It imports no torch.

    with AppThread(app) as server:
        httpx.get(server.url + "/healthz")
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class AppThread:
    """Serve `app` on `host:port` (a free port by default) from `__enter__` until `__exit__`."""

    def __init__(self, app, host: str = "127.0.0.1", port: int | None = None, name: str = "http",
                 lifespan: str = "on", start_timeout_s: float = 20.0):
        self.host = host
        self.port = port or free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.start_timeout_s = start_timeout_s
        config = uvicorn.Config(
            app, host=host, port=self.port, log_level="warning", access_log=False, lifespan=lifespan
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=name, daemon=True)

    def __enter__(self) -> AppThread:
        self.thread.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.url} did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
