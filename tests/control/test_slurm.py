"""The Slurm backend against a real single-node Slurm (.ci/setup_slurm.sh starts it; its config is
in tests/control/fixtures/slurm/): submit with GRES, run, cancel, and a Slurm requeue that
resumes from the job's checkpoint."""

import json
import os
import subprocess
import sys

import pytest

from runyard.control.backends.slurm import SlurmBackend
from runyard.control.lease_job import LeaseFolder
from runyard.control.sandbox import SandboxPolicy, wrap_argv
from runyard.control.states import FailureReason, JobState, classify_exit
from runyard.control.store import Job
from runyard.errors import EXIT_OUT_OF_MEMORY
from runyard.system.slurm import parse_sacct, parse_scontrol
from tests.system.test_slurm import FakeSlurm

from .helpers import job


def _x_after(steps):
    x = 7
    for step in range(steps):
        x = (x * 31 + step) % 1_000_003
    return x


@pytest.fixture
def slurm_daemon(daemon_factory):
    if not os.environ.get("RUNYARD_TEST_SLURM"):
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("RUNYARD_TEST_SLURM is not set, and CI=true: run .ci/setup_slurm.sh and source .ci/env")
        pytest.skip("RUNYARD_TEST_SLURM is not set (run .ci/setup_slurm.sh, then `source .ci/env`)")
    return daemon_factory("--backend", "slurm", "--slurm-gres", "gpu", "--stop-grace", "20")


def _scontrol(slurm_id: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", slurm_id], capture_output=True, text=True).stdout
    return parse_scontrol(out)


def _submit_running(d, name: str, *args: str) -> tuple[dict, str]:
    """Submit a jobscript job and wait until its code runs; returns the job and its Slurm job id."""
    j = d.client.submit([job(name, *args)])[0]
    d.wait_event(j["id"])
    return j, d.client.job(j["id"])["job"]["backend_id"]


@pytest.mark.slow
@pytest.mark.slurm
def test_submit_with_gres_and_run(slurm_daemon):
    d = slurm_daemon
    j = d.client.submit([job("gres", "--steps", "3", devices=2, time_limit_s=600)])[0]
    final = d.client.wait(j["id"], timeout_s=60)
    assert final["state"] == "succeeded" and final["exit_code"] == 0
    info = _scontrol(final["backend_id"])
    assert info["TresPerNode"] == "gres:gpu:2" and info["Requeue"] == "1"
    script = (d.state_dir / "jobs" / str(j["id"]) / "attempt-1.sbatch").read_text()
    assert "#SBATCH --signal=B:TERM@60" in script and "#SBATCH --time=10" in script
    assert "step 3" in d.client.logs(j["id"])["text"]


@pytest.mark.slow
@pytest.mark.slurm
def test_cancel(slurm_daemon):
    d = slurm_daemon
    j, slurm_id = _submit_running(d, "long", "--steps", "600", "--step-s", "0.1")
    d.client.cancel(j["id"])
    final = d.client.wait(j["id"], timeout_s=60)
    assert final["state"] == "cancelled"
    assert _scontrol(slurm_id)["JobState"] == "CANCELLED"


@pytest.mark.slow
@pytest.mark.slurm
def test_slurm_requeue_resumes_from_the_checkpoint(slurm_daemon):
    d = slurm_daemon
    j, slurm_id = _submit_running(d, "resumable", "--steps", "40", "--step-s", "0.1")
    subprocess.run(["scontrol", "requeue", slurm_id], check=True)  # what Slurm does after a node failure
    final = d.client.wait(j["id"], timeout_s=120)
    assert final["state"] == "succeeded" and final["backend_id"] == slurm_id  # the same Slurm job ran it again
    events = [e for e in d.events_of() if int(e["job"]) == j["id"]]
    assert [e["kind"] for e in events] == ["start", "preempted", "start", "done"]
    assert events[2]["restart"] == 1 and events[2]["step"] == events[1]["step"] > 0
    assert events[-1]["x"] == _x_after(40)
    states = [h["to_state"] for h in d.client.job(j["id"])["history"]]
    assert states[-3:] == ["recovering", "running", "succeeded"]


def test_parsers_read_real_output_shapes():
    line = ("JobId=12 JobName=runyard-3-x UserId=root(0) JobState=RUNNING Reason=None Dependency=(null) "
            "Requeue=1 Restarts=1 ExitCode=0:0 TRES=cpu=1,node=1,billing=1,gres/gpu=2")
    parsed = parse_scontrol(line)
    assert parsed["JobState"] == "RUNNING" and parsed["Restarts"] == "1" and parsed["TRES"].endswith("gres/gpu=2")
    assert parse_sacct("12|COMPLETED|0:0\n12.batch|COMPLETED|0:0\n") == {"State": "COMPLETED", "ExitCode": "0:0"}
    assert parse_sacct("12|CANCELLED by 0|0:15\n") == {"State": "CANCELLED", "ExitCode": "0:15"}


class _SlurmSays(SlurmBackend):
    """The backend with Slurm's answer about one job fixed (this Slurm has no memory enforcement)."""

    def __init__(self, answer: dict[str, str]):
        super().__init__()
        self.answer = answer

    def _query(self, slurm_id: str) -> dict[str, str] | None:
        return self.answer


def _ended_job(tmp_path, state: JobState = JobState.RUNNING) -> Job:
    return Job(id=1, name="j", tenant="t", priority=0, devices=1, argv=["x"], env={}, run_dir=str(tmp_path),
                    log_path=str(tmp_path / "job.log"), depends_on=None, time_limit_s=None, retry_policy={}, lease_id=None,
                    state=state, failure=None, detail=None, restart_count=0, attempt=1, allocation=[],
                    pid=None, pid_start_time=None, backend_id="77", exit_code=None, failures=[], next_start_at=None,
                    signalled_at=None, attempt_started_at=0.0, submitted_at=0.0, started_at=0.0, ended_at=None)


def test_slurm_out_of_memory_is_the_jobs_fault_even_when_its_shim_saw_only_a_sigkill(tmp_path):
    ended_job = _ended_job(tmp_path)
    (tmp_path / "attempt-1.exit.json").write_text(json.dumps({"returncode": None, "signal": 9}))
    out = _SlurmSays({"JobState": "OUT_OF_MEMORY", "ExitCode": "0:125"}).poll(ended_job)
    assert out.returncode == EXIT_OUT_OF_MEMORY and "OUT_OF_MEMORY" in out.detail
    assert classify_exit(out.returncode, out.signal) == (None, FailureReason.OUT_OF_MEMORY)
    lost = _SlurmSays({"JobState": "NODE_FAIL", "ExitCode": "0:0"}).poll(ended_job)  # the shim's file wins there
    assert classify_exit(lost.returncode, lost.signal) == (None, FailureReason.INFRA)


def test_the_backend_reads_slurms_commands_through_their_fallbacks(tmp_path, monkeypatch):
    """Against stand-ins for Slurm's binaries: a live job from squeue, a requeue noticed (PENDING after
    RUNNING), and a job only accounting remembers, cancelled."""
    fake = FakeSlurm(tmp_path / "fake-slurm", monkeypatch)
    running = _ended_job(tmp_path, JobState.STARTING)
    backend = SlurmBackend()
    fake.add("squeue", "echo 'RUNNING|None'")
    assert backend.poll(running) is None and backend.is_running(running)
    fake.add("squeue", "echo 'PENDING|JobHeldAdmin'")
    requeued = backend.poll(running)
    assert "Slurm requeued job 77 (JobHeldAdmin)" in requeued.detail
    fake.add("squeue", "exit 1")
    fake.add("scontrol", "exit 1")
    fake.add("sacct", "case \"$*\" in *JobID,State,ExitCode*) echo '77|CANCELLED by 0|0:15';; esac")
    cancelled = backend.poll(running)
    assert cancelled.returncode is None and cancelled.signal == 15 and "cancelled" in cancelled.detail
    assert len(fake.calls("sacct")) == 2  # the accounting probe (once), then the job


@pytest.mark.slow
@pytest.mark.slurm
def test_a_lease_job_runs_in_the_sandbox_under_slurm(slurm_daemon, sandboxed, tmp_path):
    """The command a lease's job is queued with (the sandbox launcher) runs as a Slurm batch job:
    the job writes its work folder, but sees neither the provider's files nor the batch job's environment."""
    d = slurm_daemon
    (tmp_path / "secret.txt").write_text("provider secret")
    folder = LeaseFolder(tmp_path / "agent" / "lease-9").create()
    SandboxPolicy(lease_id=9, root=str(folder.root)).save(folder.policy)
    script = ("import json, os, sys\n"
              "try:\n    leaked = open(sys.argv[1]).read()\nexcept OSError as exc:\n    leaked = None\n"
              "json.dump({'leaked': leaked, 'env': sorted(os.environ)}, open('run/out.json', 'w'))")
    argv = wrap_argv([sys.executable, "-c", script, str(tmp_path / "secret.txt")], folder.policy)
    j = d.client.submit([{"name": "lease-9", "argv": argv, "devices": 1, "run_dir": str(folder.run_dir)}])[0]
    final = d.client.wait(j["id"], timeout_s=120)
    assert final["state"] == "succeeded", d.client.logs(j["id"])["text"][-2000:]
    out = json.loads((folder.run_dir / "out.json").read_text())
    assert out["leaked"] is None and "RUNYARD_CONTROL_JOB" in out["env"]
    assert not any(name.startswith("SLURM_") for name in out["env"])  # the batch job's variables stay outside
    assert "runyard sandbox: lease 9, bubblewrap" in d.client.logs(j["id"])["text"]
