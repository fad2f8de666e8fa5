"""Typed market errors. Each maps to one HTTP status and a stable `code`, and carries a message that
says what was wrong and where. Raising one inside a store transaction rolls it back, so a refused
request changes nothing."""

from __future__ import annotations

from runyard.errors import RunyardError


class MarketError(RunyardError):
    """A request the market refuses (the base of every error below)."""

    status = 400
    code = "bad_request"

    def __init__(self, message: str, **detail: object):
        super().__init__(message)
        self.message = message
        self.detail = detail

    def to_json(self) -> dict:
        return {
            "error": self.code,
            "message": self.message,
            **({"detail": self.detail} if self.detail else {}),
        }


class BadRequest(MarketError):
    """The request is malformed or names impossible values (a window ending before it starts...)."""

    status = 422
    code = "invalid_request"


class Unauthenticated(MarketError):
    """No valid credentials: a missing or unknown bearer token, or a rail event's bad signature."""

    status = 401
    code = "unauthenticated"


class Forbidden(MarketError):
    """The caller is known but its role, ownership or verification does not allow this."""

    status = 403
    code = "forbidden"


class NotVerified(Forbidden):
    """The caller's account is not verified (or its verification was revoked)."""

    code = "not_verified"


class NotFound(MarketError):
    """Missing, or not the caller's to see (we never tell a tenant another tenant's ids exist)."""

    status = 404
    code = "not_found"


class Conflict(MarketError):
    """The request conflicts with the current state: a name or key taken, a window closed, ..."""

    status = 409
    code = "conflict"


class InvalidTransition(Conflict):
    """A state machine refused a transition: wrong current state or wrong actor."""

    code = "invalid_transition"


class IdempotencyConflict(Conflict):
    """The same idempotency key was sent before with different parameters."""

    code = "idempotency_key_reused"


class InsufficientFunds(Conflict):
    """An account that must not go negative would: an overdraft or an under-funded escrow."""

    code = "insufficient_funds"


class SignatureInvalid(MarketError):
    """A signed payload's signature does not verify against the signer's registered key."""

    status = 422
    code = "signature_invalid"


class UsageRejected(Conflict):
    """A usage record that is replayed, out of sequence, out of window or overlapping."""

    code = "usage_rejected"


class PayloadTooLarge(MarketError):
    """The request body is over the market's limit; it was not read."""

    status = 413
    code = "payload_too_large"


class StoreBusy(MarketError):
    """The store stayed contended through every retry; the request changed nothing and may be retried."""

    status = 503
    code = "store_busy"


class LimitExceeded(Conflict):
    """A per-account limit (deposits or withdrawals per day, balance) would be exceeded."""

    code = "limit_exceeded"


class EscrowShort(Conflict):
    """Settlement would pay out more than a lease's escrow holds (a bug or a bad record): the lease is
    reported and skipped, never paid from someone else's money."""

    code = "escrow_short"
