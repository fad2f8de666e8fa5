"""Typed errors shared across runyard. Each carries what the user needs to fix the problem.

Exit codes are part of the contract with the control plane (control/ reads them to classify a
failed job), so they live here, beside the errors that produce them.
"""

EXIT_OK = 0
EXIT_FAILURE = 1  # an error in the training code or its inputs (user_error)
EXIT_BAD_SPEC = 2  # the spec (or a command line) was rejected before any work started
EXIT_GATE_FAILED = 3  # a stage's gates failed; later stages did not start
EXIT_PREEMPTED = 4  # stopped by SIGTERM/SIGINT after writing a checkpoint; resume continues it
EXIT_OUT_OF_MEMORY = 5  # killed by the kernel for going past the job's memory limit (its cgroup's OOM killer)
EXIT_NON_FINITE = 6  # a stage's loss or gradient norm went non-finite; stopped before that optimizer step
EXIT_NOT_FIT = 7  # the run finished (evaluated, exported) but its verdict is not fit to ship


class RunyardError(Exception):
    """Base class: an error runyard reports to the user without a traceback."""

    exit_code = EXIT_FAILURE


class SpecError(RunyardError):
    """A job spec failed validation. `problems` lists (field path, bad value, what was expected)."""

    exit_code = EXIT_BAD_SPEC

    def __init__(self, source: str, problems: list[tuple[str, object, str]]):
        self.source = source
        self.problems = problems
        lines = [f"invalid spec {source}:"]
        for path, value, expected in problems:
            lines.append(f"  {path}: got {value!r}; {expected}")
        super().__init__("\n".join(lines))


class SpecChanged(RunyardError):
    """An edited spec would change work a run directory has already done (runyard.run.continuation)."""

    exit_code = EXIT_BAD_SPEC


class DataError(RunyardError):
    """The data stage cannot go on: empty corpus, unreadable source, a checksum mismatch..."""


class ResidencyError(DataError):
    """Data would be written to, or copied into, a store outside the spec's allowed regions."""


class CheckpointCorrupt(RunyardError):
    """A checkpoint failed its checksum manifest or is incomplete."""


class GateFailed(RunyardError):
    """A stage's gates failed; the run stops before any later stage."""

    exit_code = EXIT_GATE_FAILED


class NotFitToShip(RunyardError):
    """The run finished, its model exported and its report written, but the verdict is not fit to ship
    (the message names each bound that failed). Retrying the same spec gives the same verdict."""

    exit_code = EXIT_NOT_FIT


class Preempted(RunyardError):
    """Training stopped on a signal after a checkpoint was written."""

    exit_code = EXIT_PREEMPTED


class InsufficientDiskSpace(RunyardError):
    """Refused before any work: the run's estimated disk needs exceed the free space (the figures say
    which path, how much is needed and how much is free)."""


class DiskFull(RunyardError):
    """A write failed for lack of space; the message names what was being written, where, how much it
    needed and how much was free."""
