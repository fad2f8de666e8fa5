"""The control verbs through the real command line, against a real daemon."""

import subprocess
import sys

import pytest

from .helpers import job


def runyard(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runyard", *args], capture_output=True, text=True, timeout=60)


def test_verbs_without_a_daemon_say_how_to_start_one(tmp_path):
    out = runyard("queue", "--state-dir", str(tmp_path))
    assert out.returncode == 1 and "no control plane is running" in out.stderr and "runyard control start" in out.stderr


@pytest.mark.slow
def test_submit_queue_show_logs_cancel(daemon_factory, tmp_path):
    d = daemon_factory("--cpu-slots", "1")
    state = str(d.state_dir)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmodle: {}\n")
    out = runyard("submit", str(bad), "--state-dir", state)
    assert out.returncode == 2 and "modle" in out.stderr and "unknown key" in out.stderr
    assert d.client.jobs() == []  # rejected before it reached the queue

    first = d.client.submit([job("hello", "--steps", "2")])[0]
    d.client.wait(first["id"])
    show = runyard("job", "show", str(first["id"]), "--state-dir", state)
    assert show.returncode == 0 and show.stdout.startswith(f"job {first['id']} hello: succeeded")
    assert "pending -> starting   by scheduler: allocated cpu:0" in show.stdout
    assert "running -> succeeded  by control-loop: exit 0" in show.stdout
    logs = runyard("job", "logs", str(first["id"]), "--state-dir", state, "--follow")
    assert logs.returncode == 0 and "step 2 x" in logs.stdout
    queue = runyard("queue", "--all", "--state-dir", state)
    assert "hello" in queue.stdout and "succeeded" in queue.stdout
    status = runyard("control", "status", "--state-dir", state)
    assert status.returncode == 0 and "1/1 devices free" in status.stdout
    missing = runyard("job", "cancel", "999", "--state-dir", state)
    assert missing.returncode == 1 and "no job 999" in missing.stderr
