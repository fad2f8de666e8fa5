"""The shim records how its child ended in a status file, written atomically (real processes)."""

import json
import subprocess
import sys


def _shim(status, *command: str) -> int:
    return subprocess.run([sys.executable, "-m", "runyard.control.shim", str(status), "--", *command],
                          capture_output=True, timeout=60).returncode


def test_the_childs_exit_code_and_a_launch_failure_are_recorded(tmp_path):
    status = tmp_path / "attempt-1.exit.json"
    assert _shim(status, sys.executable, "-c", "raise SystemExit(3)") == 3
    record = json.loads(status.read_text())
    assert record["returncode"] == 3 and record["signal"] is None and record["ended_at"] >= record["started_at"]

    assert _shim(status, str(tmp_path / "no-such-program")) == 127
    record = json.loads(status.read_text())  # replaced whole, not appended to
    assert record["returncode"] == 127 and "no-such-program" in record["launch_error"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attempt-1.exit.json"]  # no temporary left behind


def test_a_child_killed_by_a_signal_is_recorded_as_that_signal(tmp_path):
    status = tmp_path / "exit.json"
    assert _shim(status, sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)") == 128 + 9
    record = json.loads(status.read_text())
    assert record["returncode"] is None and record["signal"] == 9
