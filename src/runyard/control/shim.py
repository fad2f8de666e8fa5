"""The process that stands between the control plane and a job: `python -m runyard.control.shim`.

It runs the job's command as its child, and when the child ends writes how it ended (exit code or
signal) atomically to a status file. Because the shim leads its own session, it outlives a daemon
killed with SIGKILL, and a restarted daemon still learns how the job ended although it is no
longer the job's parent. The job's command dies with the shim (parent-death signal): a shim killed
alone never leaves its job running unwatched. Standard library, runyard.system.files and runyard.system.processes
only: it starts fast and imports nothing heavy.

    python -m runyard.control.shim STATUS_FILE [--forward-signals] -- COMMAND [ARGS...]

Without --forward-signals the shim ignores SIGTERM/SIGINT (the local backend signals the whole
process group, so the child already has it). With it (Slurm signals only the batch shell), the shim
passes each signal on to the child's process group.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from runyard.system.files import atomic_write_text
from runyard.system.processes import die_with_parent


def main(argv: list[str]) -> int:
    if "--" not in argv or argv.index("--") < 1:
        print("usage: python -m runyard.control.shim STATUS_FILE [--forward-signals] -- CMD...", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    status_file, forward = options[0], "--forward-signals" in options[1:]
    child: subprocess.Popen | None = None

    def on_signal(signum: int, _frame: object) -> None:
        if forward and child is not None and child.poll() is None:
            os.kill(child.pid, signum)

    # A Python-level handler (not SIG_IGN) so the child starts with the default disposition.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    started = time.time()
    shim = os.getpid()
    try:
        child = subprocess.Popen(command, preexec_fn=lambda: die_with_parent(signal.SIGKILL, shim))
    except OSError as exc:
        print(f"runyard shim: cannot start {command[0]!r}: {exc}", file=sys.stderr, flush=True)
        atomic_write_text(status_file, json.dumps({"returncode": 127, "signal": None, "launch_error": str(exc)}))
        return 127
    while True:
        try:
            code = child.wait()
            break
        except InterruptedError:  # pragma: no cover - PEP 475 retries, kept for clarity
            continue
    sig = -code if code < 0 else None
    status = {
        "returncode": None if sig else code,
        "signal": sig,
        "child_pid": child.pid,
        "started_at": started,
        "ended_at": time.time(),
    }
    atomic_write_text(status_file, json.dumps(status))
    return 128 + sig if sig else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
