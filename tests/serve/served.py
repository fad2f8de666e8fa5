"""`runyard serve` as a real process for tests: started on a free port, dying with the test, returned once
its `/healthz` answers 200."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from runyard.system.http_thread import free_port
from runyard.system.processes import popen_dying_with_me


def start_served(path: Path, *options: str, timeout_s: float = 60, poll_s: float = 0.1,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """(the server process, its base URL) for `runyard serve PATH OPTIONS...` on one torch thread. Fails the
    test with the server's stderr if it exits first, or when it is not healthy within `timeout_s`."""
    port = free_port()
    proc = popen_dying_with_me([sys.executable, "-m", "runyard", "serve", str(path), "--port", str(port), *options],
                               env=env or dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
            try:
                if httpx.get(f"{url}/healthz").status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"runyard serve {path} was not healthy in {timeout_s} s"
            time.sleep(poll_s)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
