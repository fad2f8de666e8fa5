"""The control-plane daemon: the state file, the control loop, the HTTP API, and (optionally) the agent.

One daemon per state directory, guaranteed by an exclusive lock, so two daemons can never start
the same job. At start it makes (once) the API's bearer token, `api-token` (0600, see
control/auth.py); once its API listens it writes `daemon.json` (pid, host, port) atomically into
the state directory. The CLI reads both to reach the daemon.

With a market, lease jobs run in the sandbox (control/sandbox.py): the daemon checks at start that
bubblewrap runs here and refuses to start otherwise, unless the operator explicitly allows lease
jobs to run unconfined.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runyard.control import procs, sandbox
from runyard.control.agent import LeaseJobSettings, MarketAgent
from runyard.control.auth import TokenError, ensure_token
from runyard.control.backends.local import LocalBackend
from runyard.control.backends.slurm import SlurmBackend
from runyard.control.info import INFO_FILE, ControlError
from runyard.control.loop import ControlConfig, ControlLoop
from runyard.control.server import ControlServer
from runyard.control.store import JobStore
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.control")
LOOPBACK = ("127.0.0.1", "::1", "localhost")


@dataclass
class DaemonOptions:
    config: ControlConfig
    backend: str = "local"
    host: str = "127.0.0.1"
    port: int = 0
    slurm: dict[str, Any] = field(default_factory=dict)  # partition, gres kind, extra sbatch args
    market_url: str | None = None
    provider_key: str | None = None
    usage_interval_s: float = 30.0
    lease_jobs: str | None = None  # where tenants drop lease jobs when the market does not carry them
    deliveries_root: str | None = None  # the only folder (with lease_jobs) results may be delivered into
    lease_settings: LeaseJobSettings = field(default_factory=LeaseJobSettings)
    allow_argv: bool = False  # the API accepts arbitrary commands, not only job specs


def detect_inventory(devices: str | None = None, cpu_slots: int | None = None) -> list[str]:
    """Device ids this machine offers: explicit `--devices cuda:0,1`, N CPU slots, or what it finds."""
    if devices:
        ids = [d.strip() for d in devices.split(",") if d.strip()]
        kind = ids[0].split(":")[0] if ":" in ids[0] else "cuda"
        ids = [d if ":" in d else f"{kind}:{d}" for d in ids]
        if len(set(ids)) != len(ids) or any(d.split(":")[0] not in ("cuda", "cpu") for d in ids):
            raise ControlError(f"--devices {devices!r}: expected distinct ids like cuda:0,cuda:1 or cpu:0,cpu:1")
        return ids
    if cpu_slots:
        return [f"cpu:{i}" for i in range(cpu_slots)]
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
            gpus = [line for line in out.splitlines() if line.startswith("GPU ")]
            if gpus:
                return [f"cuda:{i}" for i in range(len(gpus))]
        except (OSError, subprocess.SubprocessError):
            pass
    return [f"cpu:{i}" for i in range(os.cpu_count() or 1)]


def make_backend(options: DaemonOptions) -> LocalBackend | SlurmBackend:
    if options.backend == "local":
        return LocalBackend(procs.instance_id(options.config.state_dir))
    if options.backend == "slurm":
        return SlurmBackend(**options.slurm)
    raise ControlError(f"--backend {options.backend!r}: expected 'local' or 'slurm'")


def check_lease_sandbox(options: DaemonOptions) -> None:
    """With a market: bubblewrap must run lease jobs here, unless the operator allowed them unconfined."""
    if not options.market_url:
        return
    try:
        sandbox.probe()
    except sandbox.SandboxUnavailable as exc:
        if not options.lease_settings.unconfined:
            raise ControlError(f"lease jobs run in a sandbox, and {exc}. To run strangers' jobs without one "
                               "(they would see this machine's files and network), start with "
                               "--unconfined-lease-jobs") from None
        log.warning("lease jobs run UNCONFINED (--unconfined-lease-jobs): %s", exc)


def make_private(state_dir: Path) -> None:
    """The state directory 0700 and the files the control plane writes there 0600, whatever the umask
    (the database names jobs, tenants and run directories; the log, what the daemon did for them).
    The log is opened by `runyard control start` before the daemon runs, so it is fixed here too."""
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)
    for name in ("daemon.log", "control.db", "control.db-wal", "control.db-shm", "daemon.lock"):
        with contextlib.suppress(FileNotFoundError):
            os.chmod(state_dir / name, 0o600)


def run_daemon(options: DaemonOptions) -> int:
    """Run in the foreground until SIGTERM/SIGINT or POST /shutdown. Jobs keep running after it."""
    if options.host not in LOOPBACK:
        raise ControlError(f"--host {options.host}: the control API listens on loopback only")
    state_dir = Path(options.config.state_dir)
    make_private(state_dir)
    lock_fh = open(state_dir / "daemon.lock", "a+")  # noqa: SIM115 - held for the daemon's lifetime
    os.chmod(state_dir / "daemon.lock", 0o600)
    try:
        fcntl.flock(lock_fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ControlError(f"a control plane is already running on {state_dir} (see daemon.json)") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        token = ensure_token(state_dir)
    except TokenError as exc:
        raise ControlError(str(exc)) from None
    check_lease_sandbox(options)
    store = JobStore(state_dir / "control.db")
    loop = ControlLoop(options.config, store, make_backend(options))
    agent = None
    if options.market_url:  # made before the API answers: a bad key file stops the start here
        agent = MarketAgent(loop, options.market_url, options.provider_key, options.usage_interval_s,
                            lease_jobs=options.lease_jobs, deliveries_root=options.deliveries_root,
                            settings=options.lease_settings)
    stop = threading.Event()
    server = ControlServer(loop, options.host, options.port, on_shutdown=stop, token=token,
                           allow_argv=options.allow_argv)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    loop.reconcile()  # before the API answers: what it reports is already reconciled
    threading.Thread(target=server.serve_forever, name="control-api", daemon=True).start()
    info = {"pid": os.getpid(), "host": options.host, "port": server.server_address[1],
            "backend": options.backend, "started_at": time.time(), "devices": options.config.inventory}
    atomic_write_text(state_dir / INFO_FILE, json.dumps(info))
    if agent is not None:
        agent.start(stop)
    log.info("control plane on http://%s:%s, state in %s, backend %s, devices %s", options.host,
             info["port"], state_dir, options.backend, ",".join(options.config.inventory))
    stop_watch = threading.Thread(target=lambda: (stop.wait(), loop.wake.set()), daemon=True)
    stop_watch.start()
    try:
        loop.run_forever(stop)
    finally:
        server.shutdown()
        if agent is not None:
            agent.join(timeout=5)
        (state_dir / INFO_FILE).unlink(missing_ok=True)
        store.close()
        lock_fh.close()
    return 0
