"""A job's states and the only transitions allowed between them: one table, in one module.

Nothing changes a job's state except `JobStore.transition`, which checks this table and writes the
transition (actor, time, reason) to the database *before* the caller acts on it. A daemon that dies
between writing and acting finds the intent on restart and reconciles (see `ControlLoop.reconcile`).

    pending -> starting -> running -> succeeded
    running -> recovering -> running            (restart from the last good checkpoint)
    running -> preempted -> pending             (SIGTERM, checkpoint, exit 4, queue again)
    * -> cancelling -> cancelled
    * -> failed (with a FailureReason)
"""

from __future__ import annotations

from enum import StrEnum

from runyard.errors import (
    EXIT_BAD_SPEC,
    EXIT_GATE_FAILED,
    EXIT_NOT_FIT,
    EXIT_OK,
    EXIT_OUT_OF_MEMORY,
    EXIT_PREEMPTED,
    RunyardError,
)

# The sandbox launcher's own exit code (control plane only; training code never exits 8): the job went
# past its lease's disk quota (runyard.control.disk_quota). The tenant's, like a heap overrun.
EXIT_DISK_QUOTA = 8


class JobState(StrEnum):
    PENDING = "pending"  # queued; holds no devices
    STARTING = "starting"  # devices allocated, launch intended (a crash here is resolved on restart)
    RUNNING = "running"  # the process (or Slurm job) is alive
    RECOVERING = "recovering"  # the process died; waiting out the backoff before relaunching
    PREEMPTED = "preempted"  # SIGTERM sent; waiting for the checkpoint and exit 4
    CANCELLING = "cancelling"  # cancel requested; waiting for the process to go
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL

    @property
    def holds_devices(self) -> bool:
        """States in which the job's allocation is reserved for it."""
        return self in HOLDS_DEVICES


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
HOLDS_DEVICES = frozenset(
    {JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.PREEMPTED, JobState.CANCELLING}
)


class FailureReason(StrEnum):
    """Why a job failed (or why an attempt ended badly). Picks the retry budget that applies."""

    USER_ERROR = "user_error"  # the training code exited non-zero and the machine was fine
    BAD_SPEC = "bad_spec"  # exit 2: rejected before any work; retrying cannot help
    INFRA = "infra"  # killed by a signal, process lost, node lost, launch failed
    NO_CAPACITY = "no_capacity"  # asks for more devices than this provider has
    GATE_FAILED = "gate_failed"  # exit 3: a stage's gates failed
    OUT_OF_MEMORY = "out_of_memory"  # exit 5: past its memory limit; the same limit gives the same end
    DISK_QUOTA = "disk_quota"  # exit 8: a lease job past its disk quota; the same job fills the same quota
    NOT_FIT_TO_SHIP = "not_fit_to_ship"  # exit 7: finished and exported, judged not fit to ship; not infra
    DEPENDENCY_FAILED = "dependency_failed"  # the job it waits on (an earlier stage) did not succeed


S = JobState
# state -> states it may move to. Terminal states may only be requeued (back to pending) by a user.
TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    S.PENDING: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.PENDING, S.FAILED, S.CANCELLING, S.RECOVERING}),
    S.RUNNING: frozenset({S.SUCCEEDED, S.FAILED, S.RECOVERING, S.PREEMPTED, S.CANCELLING}),
    S.RECOVERING: frozenset({S.RECOVERING, S.RUNNING, S.FAILED, S.CANCELLING, S.PENDING}),
    S.PREEMPTED: frozenset({S.PENDING, S.SUCCEEDED, S.FAILED, S.CANCELLING, S.RECOVERING}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.SUCCEEDED: frozenset({S.PENDING}),
    S.FAILED: frozenset({S.PENDING}),
    S.CANCELLED: frozenset({S.PENDING}),
}


class IllegalTransition(RunyardError):
    """A state change that the table in control/states.py does not allow."""

    def __init__(self, job_id: int, current: JobState, target: JobState):
        allowed = ", ".join(sorted(TRANSITIONS[current])) or "nothing"
        super().__init__(f"job {job_id}: cannot go from {current} to {target} (from {current}: {allowed})")
        self.job_id, self.current, self.target = job_id, current, target


def check_transition(job_id: int, current: JobState, target: JobState) -> None:
    """Raise IllegalTransition unless `current -> target` is in the table."""
    if target not in TRANSITIONS[current]:
        raise IllegalTransition(job_id, current, target)


def classify_exit(returncode: int | None, signal_number: int | None) -> tuple[JobState | None, FailureReason | None]:
    """Map how an attempt ended to (outcome, failure class), following the exit codes in errors.py.

    Returns (SUCCEEDED, None), (PENDING, None) for a checkpointed preemption (exit 4), or
    (None, reason) for a failure that the retry policy decides about.
    """
    if signal_number is not None or returncode is None:
        return None, FailureReason.INFRA  # killed: the OOM killer, a lost node, kill -9
    if returncode == EXIT_OK:
        return JobState.SUCCEEDED, None
    if returncode == EXIT_PREEMPTED:
        return JobState.PENDING, None
    if returncode == EXIT_BAD_SPEC:
        return None, FailureReason.BAD_SPEC
    if returncode == EXIT_GATE_FAILED:
        return None, FailureReason.GATE_FAILED
    if returncode == EXIT_OUT_OF_MEMORY:
        return None, FailureReason.OUT_OF_MEMORY
    if returncode == EXIT_DISK_QUOTA:
        return None, FailureReason.DISK_QUOTA
    if returncode == EXIT_NOT_FIT:
        return None, FailureReason.NOT_FIT_TO_SHIP
    if returncode >= 128:  # a shell reporting a child killed by signal (128 + n)
        return None, FailureReason.INFRA
    return None, FailureReason.USER_ERROR
