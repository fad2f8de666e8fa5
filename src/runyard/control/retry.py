"""Retry policy per failure class: separate budgets, backoff, a time window, a clear final reason.

`infra` failures (a killed process, a lost node) are the provider's fault and get a generous
budget with exponential backoff; `user_error` (the training code exited non-zero) gets a small
budget, or only the exit codes on an allow-list are retried. `bad_spec`, `gate_failed` and
`not_fit_to_ship` (a finished run judged not fit, exit 7) are never retried: the same input gives the same answer; nor is `out_of_memory` (the job went past its
memory limit, and the same limit ends the same way: the user must ask for more). Only failures inside the window count.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from runyard.control.states import FailureReason


@dataclass(frozen=True)
class ClassBudget:
    """How many failures of one class are retried within `window_s`, and how long to wait."""

    retries: int
    backoff_s: float = 1.0  # wait before the first retry
    backoff_factor: float = 2.0
    backoff_max_s: float = 300.0
    retry_exit_codes: list[int] | None = None  # user_error only: retry these codes, fail on others

    def delay(self, failures_so_far: int) -> float:
        """Seconds to wait before retry number `failures_so_far` (1-based)."""
        return min(self.backoff_max_s, self.backoff_s * self.backoff_factor ** max(0, failures_so_far - 1))


@dataclass(frozen=True)
class RetryPolicy:
    infra: ClassBudget = field(default_factory=lambda: ClassBudget(retries=10, backoff_s=1.0))
    user_error: ClassBudget = field(default_factory=lambda: ClassBudget(retries=1, backoff_s=1.0))
    window_s: float = 3600.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> RetryPolicy:
        """Build from a (possibly partial) dict; unset parts keep their defaults."""
        raw = dict(raw or {})
        base = cls()
        kwargs: dict[str, Any] = {}
        for name in ("infra", "user_error"):
            if name in raw:
                kwargs[name] = ClassBudget(**{**asdict(getattr(base, name)), **raw.pop(name)})
        if "window_s" in raw:
            kwargs["window_s"] = float(raw.pop("window_s"))
        if raw:
            raise ValueError(f"unknown retry policy keys {sorted(raw)}; expected infra, user_error, window_s")
        return cls(**kwargs)


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    delay_s: float
    final_reason: str  # set when retry is False: what the user reads in `runyard job show`


def decide(
    policy: RetryPolicy, reason: FailureReason, exit_code: int | None, failures: list[list[Any]], now: float
) -> RetryDecision:
    """Decide about a failure of class `reason`, given earlier failures [[time, class], ...].

    `failures` must already include this one.
    """
    if reason in (FailureReason.BAD_SPEC, FailureReason.GATE_FAILED, FailureReason.NOT_FIT_TO_SHIP):
        return RetryDecision(False, 0.0, f"{reason}: exit {exit_code}; not retried (same input, same outcome)")
    if reason == FailureReason.OUT_OF_MEMORY:
        return RetryDecision(False, 0.0, f"{reason}: the job went past its memory limit and the kernel killed it; "
                                         "not retried (the same limit ends the same way): ask for more memory")
    if reason == FailureReason.DISK_QUOTA:
        return RetryDecision(False, 0.0, f"{reason}: the job went past its lease's disk quota and was stopped; "
                                         "not retried (the same job fills the same quota)")
    budget = policy.infra if reason == FailureReason.INFRA else policy.user_error
    codes = budget.retry_exit_codes
    if reason == FailureReason.USER_ERROR and codes is not None and exit_code not in codes:
        return RetryDecision(False, 0.0, f"user_error: exit {exit_code} is not in the retry list {codes}")
    recent = [f for f in failures if f[1] == str(reason) and now - f[0] <= policy.window_s]
    if len(recent) > budget.retries:
        what = f"exit {exit_code}" if exit_code is not None else "killed by a signal or lost"
        return RetryDecision(
            False,
            0.0,
            f"{reason}: {what}; retry budget spent ({len(recent)} {reason} failures within "
            f"{policy.window_s:g}s, {budget.retries} retries allowed)",
        )
    return RetryDecision(True, budget.delay(len(recent)), "")
