"""runyard.system.slurm, the one module that runs Slurm's commands, against small stand-ins for Slurm's
binaries: shell scripts named sbatch, squeue, scontrol, sacct and scancel, put first on PATH, that
print what Slurm would and record how they were called. The last test asks a real Slurm (.ci/setup_slurm.sh)."""

from __future__ import annotations

import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

from runyard.system import slurm
from runyard.system.slurm import SlurmError


class FakeSlurm:
    """A folder of fake Slurm commands first on PATH; each appends its name and arguments to a log."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch):
        self.bin, self.log = root / "bin", root / "calls.log"
        self.bin.mkdir(parents=True)
        monkeypatch.setenv("PATH", f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}")

    def add(self, name: str, body: str) -> None:
        """`name` runs the shell `body` (its arguments in "$@")."""
        path = self.bin / name
        path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{self.log}"\n{body}\n')
        path.chmod(0o755)

    def calls(self, name: str | None = None) -> list[str]:
        lines = self.log.read_text().splitlines() if self.log.exists() else []
        return [line for line in lines if name is None or line.split()[0] == name]


@pytest.fixture
def fake(tmp_path, monkeypatch) -> FakeSlurm:
    return FakeSlurm(tmp_path / "fake-slurm", monkeypatch)


SCONTROL_ENDED = ("JobId=12 JobName=runyard-3-x UserId=root(0) JobState=COMPLETED Reason=None "
                  "Requeue=1 Restarts=0 ExitCode=3:0")


# -- submit -------------------------------------------------------------------------------------------


def test_the_job_id_is_read_from_sbatch_parsable_with_and_without_a_cluster():
    assert slurm.parse_job_id("4242\n") == "4242"
    assert slurm.parse_job_id("4242;cluster-a\n") == "4242"
    assert slurm.parse_job_id("Submitted batch job 4242") is None
    assert slurm.parse_job_id("") is None


@pytest.mark.parametrize("printed", ["4242", "4242;cluster-a"])
def test_submit_returns_the_job_id_sbatch_printed(fake, tmp_path, printed):
    fake.add("sbatch", f"echo '{printed}'")
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --array=0-3%2\ntrue\n")
    assert slurm.submit(script, ["--partition=debug"]) == "4242"
    assert fake.calls("sbatch") == [f"sbatch --parsable --partition=debug {script}"]


def test_submit_passes_the_environment_it_is_given(fake, tmp_path):
    fake.add("sbatch", 'echo "$RUNYARD_SEEN"')
    assert slurm.submit(tmp_path / "s", env={**os.environ, "RUNYARD_SEEN": "77"}) == "77"


def test_a_failing_command_raises_the_one_error_with_its_exit_status_and_stderr(fake, tmp_path):
    fake.add("sbatch", "echo 'sbatch: error: Batch job submission failed: Invalid partition name specified' >&2\n"
                       "exit 1")
    with pytest.raises(SlurmError) as caught:
        slurm.submit(tmp_path / "job.sbatch", ["--partition=nope"])
    err = caught.value
    assert str(err) == "sbatch --parsable failed (1): sbatch: error: Batch job submission failed: " \
                       "Invalid partition name specified"
    assert err.returncode == 1 and err.command[:3] == ["sbatch", "--parsable", "--partition=nope"]
    assert err.stderr.endswith("Invalid partition name specified")


def test_a_failing_command_without_stderr_is_named_with_its_stdout(fake):
    fake.add("scontrol", "echo 'no such thing'\nexit 2")
    with pytest.raises(SlurmError, match=r"^scontrol show failed \(2\): no such thing$"):
        slurm.run(["scontrol", "show", "thing"])
    assert slurm.run(["scontrol", "show", "thing"], check=False).returncode == 2  # unchecked: the caller decides


def test_sbatch_printing_no_job_id_is_an_error(fake, tmp_path):
    fake.add("sbatch", "echo 'Submitted batch job soon'")
    with pytest.raises(SlurmError, match="sbatch printed 'Submitted batch job soon', not a job id"):
        slurm.submit(tmp_path / "job.sbatch")


def test_a_command_that_does_not_answer_in_time_is_the_same_error(fake):
    fake.add("squeue", "echo 'slurm_load_jobs: waiting' >&2\nexec sleep 30")
    start = time.monotonic()
    with pytest.raises(SlurmError, match=r"^squeue -h did not answer within 0.5 s$") as caught:
        slurm.job_state("12", timeout_s=0.5)
    assert time.monotonic() - start < 10
    assert caught.value.returncode is None and caught.value.command[0] == "squeue"


def test_a_command_that_is_not_installed_says_so(fake, monkeypatch):
    monkeypatch.setenv("PATH", str(fake.bin))  # nothing but the (empty) fake folder
    with pytest.raises(SlurmError, match=r"^sbatch could not be run \(.*\); is this a Slurm submit host\?$"):
        slurm.submit("job.sbatch")
    assert slurm.has_accounting() is False


# -- watch --------------------------------------------------------------------------------------------


def test_a_live_job_state_comes_from_squeue_alone(fake):
    fake.add("squeue", "echo 'PENDING|BeginTime'")
    fake.add("scontrol", "exit 1")
    assert slurm.job_state("12") == {"JobState": "PENDING", "Reason": "BeginTime"}
    assert fake.calls("squeue") == ["squeue -h -j 12 -o %T|%r"] and fake.calls("scontrol") == []


def test_an_ended_job_falls_back_from_squeue_to_scontrol(fake):
    fake.add("squeue", "echo 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1")
    fake.add("scontrol", f"echo '{SCONTROL_ENDED}'")
    fake.add("sacct", "exit 1")
    asked = []
    info = slurm.job_state("12", accounting=lambda: asked.append(1) or True)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "3:0" and info["Requeue"] == "1"
    assert slurm.parse_exit_code(info["ExitCode"]) == (3, None)
    assert fake.calls("scontrol") == ["scontrol show job -o 12"]
    assert asked == [] and fake.calls("sacct") == []  # scontrol knew: accounting is not even asked about


def test_a_job_squeue_lists_as_ended_is_read_from_scontrol_for_its_exit_code(fake):
    fake.add("squeue", "echo 'COMPLETED|None'")
    fake.add("scontrol", f"echo '{SCONTROL_ENDED}'")
    assert slurm.job_state("12")["ExitCode"] == "3:0"


def test_a_job_slurm_forgot_falls_back_to_sacct(fake):
    fake.add("squeue", "")  # prints nothing
    fake.add("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1")
    fake.add("sacct", "printf '12|CANCELLED by 0|0:15\\n12.batch|CANCELLED|0:15\\n'")
    info = slurm.job_state("12")
    assert info == {"JobState": "CANCELLED", "ExitCode": "0:15"}
    assert slurm.state_name(info) == "CANCELLED" and slurm.parse_exit_code("0:15") == (None, 15)
    assert fake.calls("sacct") == ["sacct -j 12 -X -n -P -o JobID,State,ExitCode"]


def test_without_accounting_a_forgotten_job_is_none(fake):
    fake.add("squeue", "exit 1")
    fake.add("scontrol", "exit 1")
    fake.add("sacct", "echo '12|COMPLETED|0:0'")
    assert slurm.job_state("12", accounting=False) is None
    assert slurm.job_state("12", accounting=lambda: False) is None
    assert fake.calls("sacct") == []


def test_accounting_is_there_unless_sacct_fails_or_says_it_is_disabled(fake):
    fake.add("sacct", "exit 0")
    assert slurm.has_accounting() is True
    fake.add("sacct", "echo 'Slurm accounting storage is disabled' >&2")
    assert slurm.has_accounting() is False
    fake.add("sacct", "exit 1")
    assert slurm.has_accounting() is False


def test_live_jobs_counts_any_live_array_task_and_asks_one_by_one_when_squeue_refuses_the_list(fake):
    fake.add("squeue", 'echo "100 RUNNING"\necho "100 PENDING"\necho "101 COMPLETED"')
    assert slurm.live_jobs(["100", "101"]) == ["100"]
    assert fake.calls("squeue") == ["squeue -h -r -j 100,101 -o %F %T"]
    # squeue refuses a list holding a long-gone job; alone, each is answered (102 gone, 100 live)
    fake.add("squeue", 'case "$4" in *,*) exit 1;; 100) echo "100 RUNNING";; *) exit 1;; esac')
    assert slurm.live_jobs(["102", "100"]) == ["100"]
    assert slurm.live_jobs(["102"]) == []


def test_jobs_named_lists_the_queue_ids_and_max_array_size_reads_the_config(fake):
    fake.add("squeue", 'echo "7 runyard-3-x"\necho "9 runyard-3-x"')
    assert slurm.jobs_named("runyard-3-x") == ["7", "9"]
    assert fake.calls("squeue") == ["squeue -h -o %i %j --name runyard-3-x"]
    fake.add("scontrol", "echo 'MaxArraySize            = 40001'\necho 'MaxJobCount = 10000'")
    assert slurm.max_array_size() == 40001
    fake.add("scontrol", "exit 1")
    assert slurm.max_array_size() == slurm.DEFAULT_MAX_ARRAY_SIZE == 1001


# -- stop ---------------------------------------------------------------------------------------------


def test_cancel_signals_or_cancels_and_a_job_already_gone_is_no_error(fake):
    fake.add("scancel", "exit 0")
    assert slurm.cancel("12") == 0
    assert slurm.cancel("12", signal="TERM", full=True) == 0
    fake.add("scancel", "echo 'scancel: error: Invalid job id 12' >&2\nexit 1")
    assert slurm.cancel("12", signal="KILL", full=True) == 1
    assert fake.calls("scancel") == ["scancel 12", "scancel --signal=TERM --full 12", "scancel --signal=KILL --full 12"]


# -- a real Slurm -------------------------------------------------------------------------------------


@pytest.mark.slurm
def test_against_a_real_slurm(tmp_path):
    if not os.environ.get("RUNYARD_TEST_SLURM") or shutil.which("sbatch") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("RUNYARD_TEST_SLURM is not set, and CI=true: run .ci/setup_slurm.sh and source .ci/env")
        pytest.skip("no Slurm here (run .ci/setup_slurm.sh, then `source .ci/env`)")
    name = f"rytest-{uuid.uuid4().hex[:8]}"
    script = tmp_path / "sleep.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --job-name={name}\n#SBATCH --output={tmp_path}/out.log\nsleep 300\n")
    job_id = slurm.submit(script)
    try:
        assert slurm.job_state(job_id, accounting=slurm.has_accounting)["JobState"] in slurm.LIVE_STATES
        assert slurm.jobs_named(name) == [job_id] and slurm.live_jobs([job_id]) == [job_id]
        assert slurm.max_array_size() > 1
    finally:
        assert slurm.cancel(job_id) == 0
    deadline = time.monotonic() + 60
    while slurm.live_jobs([job_id]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.live_jobs([job_id]) == []
    info = slurm.job_state(job_id, accounting=slurm.has_accounting)
    assert info is None or slurm.state_name(info) == "CANCELLED"
