"""The maintenance budget: what retraining through the market may spend per period.

A retraining demand's escrow (max price x devices x duration) is the most it can cost, so that is what
it charges against the budget, at the moment it is decided, before the market is asked: a demand whose
escrow would take the period's charges past the budget is not placed. Periods are fixed windows of
`period_s` seconds counted from the Unix epoch (a day from midnight UTC with 86400), so a restart
never starts a fresh period early.

The charges are kept in a small JSON file (written atomically) beside the request log, so the spending
survives a server restart. A charge stays counted whatever the demand then does (placed, never reached
the market, expired with its escrow returned): the budget caps what maintenance may commit, and a
demand given up on may still have reached the market. All amounts are integer minor units.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runyard.serve.errors import RetrainOverBudget, ServeConfigError
from runyard.system.files import atomic_write_text

BUDGET_FILE = "retrain-budget.json"
DEFAULT_BUDGET_PERIOD_S = 30 * 86400
FORMAT = "runyard.retrain_budget/1"


@dataclass(frozen=True)
class Period:
    """One budget period: [start, end) in Unix seconds, and what is charged in it."""

    start: int
    end: int
    spent: int


class MaintenanceBudget:
    """At most `amount` minor units of retraining escrow per `period_s` seconds, kept in `path`."""

    def __init__(self, path: Path, amount: int, period_s: int):
        if amount < 1:
            raise ServeConfigError(f"--budget must be at least 1 minor unit, got {amount}")
        if period_s < 1:
            raise ServeConfigError(f"--budget-period-s must be at least 1, got {period_s}")
        self.path, self.amount, self.period_s = Path(path), int(amount), int(period_s)
        self._lock = threading.Lock()
        self.charges: list[dict[str, Any]] = self._load()

    def _load(self) -> list[dict[str, Any]]:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as exc:
            raise ServeConfigError(f"{self.path}: the retraining budget's record cannot be read ({exc}); "
                                   "move it away only if no retraining was paid in this period") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("charges"), list):
            raise ServeConfigError(f"{self.path} is not a retraining budget record ({FORMAT})")
        return data["charges"]

    def _save(self) -> None:
        body = {"format": FORMAT, "budget": self.amount, "period_s": self.period_s, "charges": self.charges}
        atomic_write_text(self.path, json.dumps(body, indent=1) + "\n")

    def period(self, now: float) -> Period:
        """The period `now` falls in, and what is charged in it so far."""
        start = int(now) // self.period_s * self.period_s
        end = start + self.period_s
        with self._lock:
            spent = sum(int(c["amount"]) for c in self.charges if start <= c["at"] < end)
        return Period(start, end, spent)

    def charge(self, key: str, amount: int, now: float, **facts: Any) -> dict[str, Any]:
        """Charge `amount` to the period of `now` under `key` (once: charging a key again returns the
        first charge), or RetrainOverBudget saying what is left."""
        period = self.period(now)
        with self._lock:
            earlier = next((c for c in self.charges if c["key"] == key), None)
            if earlier is not None:
                return dict(earlier)
            if period.spent + amount > self.amount:
                raise RetrainOverBudget(
                    f"not placed: the demand's escrow {amount} would take this period's retraining spend to "
                    f"{period.spent + amount}, past the budget of {self.amount} per {self.period_s}s "
                    f"({self.amount - period.spent} left until {period.end})",
                    self.status(now, period))
            charge = {"key": key, "at": int(now), "amount": int(amount), **facts}
            self.charges.append(charge)
            self._save()
            return dict(charge)

    def note(self, key: str, **facts: Any) -> None:
        """Record what became of a charge's demand (its id, its state)."""
        with self._lock:
            for charge in self.charges:
                if charge["key"] == key:
                    charge.update(facts)
            self._save()

    def release(self, key: str) -> None:
        """Take back a charge whose demand the market refused (it reserved nothing)."""
        with self._lock:
            self.charges = [c for c in self.charges if c["key"] != key]
            self._save()

    def status(self, now: float, period: Period | None = None) -> dict[str, Any]:
        """The budget, the current period, what is charged and left in it, for /v1/drift."""
        period = period or self.period(now)
        return {"budget": self.amount, "period_s": self.period_s, "period_start": period.start,
                "period_end": period.end, "spent": period.spent, "left": self.amount - period.spent,
                "record": str(self.path)}
