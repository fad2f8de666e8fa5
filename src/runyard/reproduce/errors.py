"""Errors of reproduction. Each names what was wrong and what to do about it."""

from __future__ import annotations

from runyard.errors import EXIT_BAD_SPEC, RunyardError


class ReproduceError(RunyardError):
    """Base class of reproduction errors."""


class NotReproducible(ReproduceError):
    """The run directory lacks what a reproduction needs (spec, manifest, lock)."""

    exit_code = EXIT_BAD_SPEC


class LockUnsatisfiable(ReproduceError):
    """The lock cannot be installed here. `problems` lists (package, why); nothing was run."""

    exit_code = EXIT_BAD_SPEC

    def __init__(self, problems: list[tuple[str, str]], hint: str = ""):
        self.problems = problems
        lines = [f"the environment lock cannot be satisfied on this machine ({len(problems)} problem(s)); nothing was run:"]
        lines += [f"  {name}: {why}" for name, why in problems]
        if hint:
            lines.append(hint)
        super().__init__("\n".join(lines))


class InputsChanged(ReproduceError):
    """The spec or the data no longer match what the run recorded. `changes` lists (what, how)."""

    exit_code = EXIT_BAD_SPEC

    def __init__(self, changes: list[tuple[str, str]]):
        self.changes = changes
        lines = ["the run's inputs changed since it ran; nothing was run:"]
        lines += [f"  {what}: {how}" for what, how in changes]
        lines.append("pass --allow-changed-inputs to rerun anyway (the report will then name these as causes)")
        super().__init__("\n".join(lines))


class EnvironmentBuildFailed(ReproduceError):
    """Building the environment failed after its checks passed (a pip error, a verification mismatch)."""


class RerunFailed(ReproduceError):
    """The rerun of the spec did not finish."""
