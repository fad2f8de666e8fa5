"""Errors of the serving side. The HTTP layer turns each into OpenAI's error shape with its status."""

from __future__ import annotations

from runyard.errors import EXIT_BAD_SPEC, RunyardError


class ServeError(RunyardError):
    """Base class of serving errors."""


class ServeConfigError(ServeError):
    """The serve command's options contradict each other or the export (exit 2, before loading)."""

    exit_code = EXIT_BAD_SPEC


class InvalidRequest(ServeError):
    """A request the server will not run: `param` names the offending field (OpenAI's `param`)."""

    status = 400
    kind = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


class ModelNotFound(InvalidRequest):
    status = 404

    def __init__(self, message: str):
        super().__init__(message, param="model", code="model_not_found")


class QueueFull(ServeError):
    """Admission control: the queue is at its bound; the client should retry after `retry_after_s`."""

    def __init__(self, depth: int, bound: int, retry_after_s: int):
        super().__init__(f"the server's queue is full ({depth} sequences waiting, bound {bound}); retry later")
        self.retry_after_s = retry_after_s


class EngineUnavailable(ServeError):
    """The engine is stopped or failed; requests cannot be served."""


class RetrainError(ServeError):
    """A retraining submission could not be prepared or sent; `details` (a dict) goes on the event's
    record beside the message (what was tried, and when)."""

    def __init__(self, message: str, details: dict | None = None):
        super().__init__(message)
        self.details = details or {}


class RetrainRefused(RetrainError):
    """A retraining not submitted by policy (too few logged records would be used); `traffic` holds the
    counts that decided it."""

    def __init__(self, message: str, traffic: dict):
        super().__init__(message)
        self.traffic = traffic


class RetrainOverBudget(RetrainError):
    """A retraining demand not placed: its escrow would take the period's spend past the maintenance
    budget; `budget` holds the period's figures."""

    def __init__(self, message: str, budget: dict):
        super().__init__(message)
        self.budget = budget


class RetrainDeferred(RetrainError):
    """A retraining whose destination could not be reached this time: `outcome` records the attempts so
    far, and it is tried again after `retry_in_s` seconds."""

    def __init__(self, message: str, outcome: dict, retry_in_s: float):
        super().__init__(message)
        self.outcome, self.retry_in_s = outcome, retry_in_s
