"""Finding the running daemon: `daemon.json` in its state directory (standard library only, so the
CLI and the client start fast without the daemon's machinery)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from runyard.errors import RunyardError

INFO_FILE = "daemon.json"


class ControlError(RunyardError):
    """The control plane could not do what was asked (not running, already running, bad setting...)."""


def read_daemon_info(state_dir: str | Path) -> dict[str, Any]:
    """The running daemon's pid/host/port, or ControlError if none runs on this state directory."""
    path = Path(state_dir) / INFO_FILE
    try:
        info = json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        raise ControlError(
            f"no control plane is running on {state_dir}; start one with `runyard control start --state-dir "
            f"{state_dir}`"
        ) from None
    try:
        os.kill(info["pid"], 0)
    except ProcessLookupError:
        raise ControlError(f"the control plane on {state_dir} (pid {info['pid']}) is not running; "
                           "start it again with `runyard control start`") from None
    return info
