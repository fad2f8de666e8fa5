"""Identity verifiers: who decides whether an account is verified.

A market is opened with one verifier (`Market.open(..., verifier=...)`); the service never picks
one itself. `OperatorVerifier` decides nothing: a request waits in `pending` until an operator
approves or rejects it. A verifier that checks documents automatically returns its decision from
`review` and the market applies it as the system actor.
"""

from __future__ import annotations

from typing import Protocol


class Verifier(Protocol):
    """Decides verification requests. Return (approved, reason), or None to leave it to an operator."""

    def review(self, account: dict, evidence: str) -> tuple[bool, str] | None: ...


class OperatorVerifier:
    """Every request waits for an operator (`runyard market admin verify`)."""

    def review(self, account: dict, evidence: str) -> tuple[bool, str] | None:
        return None


class AutoApproveVerifier:
    """Approves every request at once: for demos and benchmarks, never for a real market."""

    def review(self, account: dict, evidence: str) -> tuple[bool, str] | None:
        return True, "auto-approved (demo verifier)"
