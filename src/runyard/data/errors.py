"""Errors of the data stage (all `DataError`s: the CLI reports them without a traceback)."""

from __future__ import annotations

from runyard.errors import DataError


class InputChanged(DataError):
    """A source file disappeared or changed while the data stage read it: the cache keeps nothing that
    mixes its old and new contents, and the message names the file and what changed."""


class DocumentTooLarge(DataError):
    """One document is larger than a worker's share of data.memory_limit can clean."""


class MemoryBudgetTooSmall(DataError):
    """data.memory_limit cannot hold the processes asked for."""


class TaskFailed(DataError):
    """A step's task failed on its executor (and on its retries); the message names the task and its log."""
