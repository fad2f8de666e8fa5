"""Retraining through the market: a drift event places one funded block demand.

The server is started with the spec to retrain from, the market and the tenant's identity, and a
maintenance budget (`--retrain-via market --market URL --identity FILE --budget N`). On a drift event
(serve/watch.py: one per drift episode) the `MarketRetrainer` builds the retraining's job
(serve/retrain_job.py: the derived spec, the newest logged traffic, the served export as `init_export`,
the run's environment lock) and places a block demand for the spec's `resources.requirement`, at most
`max_price` per device-hour, to start by `deadline_s` from now (a demand that finds no capacity by then
expires and the market returns its escrow).

Money: the demand's escrow (max price x devices x duration, the most it can cost) is charged to the
maintenance budget (serve/retrain_budget.py) before the market is asked; a demand that would go past the
period's budget is not placed, and the event records why. Without `--max-price` the price is the most the
whole budget pays for the requirement.

A market that cannot be reached (or answers 5xx) is tried again with backoff, the same demand under the
same idempotency key, so a request that reached the market but whose answer was lost never places a
second demand; every attempt and its error is on the event (`/v1/drift`). After the deadline it gives up.
A refusal (4xx) is final: recorded, and its charge released, since the market reserved nothing.

Everything that can be checked before traffic arrives is checked at start (`check_runnable` on the job
built with a placeholder record): a spec the market or a provider would refuse stops the server from
starting (exit 2, the field named).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from runyard.market.client import MarketClient, MarketClientError
from runyard.market.lineage import retraining_name
from runyard.market.pricing import cost
from runyard.serve.errors import RetrainDeferred, RetrainError, RetrainRefused, ServeConfigError
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain import (
    DEFAULT_MIN_LOGGED,
    SPECS_DIR,
    read_spec_mapping,
    refusal_reason,
    usable_traffic,
)
from runyard.serve.retrain_budget import MaintenanceBudget
from runyard.serve.retrain_job import RetrainJob, build_job, check_runnable, env_lock_of, init_export_for
from runyard.spec.data import DataSpec, SourceSpec
from runyard.spec.job import parse_spec
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.serve")

DEFAULT_DEADLINE_S = 3600
RESULTS_DIR = "retrain-results"
BACKOFF_S = 1.0
BACKOFF_MAX_S = 60.0


def _iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Placement:
    """A retraining demand decided and charged, being placed (kept across attempts)."""

    key: str
    name: str
    job: dict[str, Any]
    requirement: dict[str, Any]
    escrow: int
    deadline: int  # Unix seconds: the demand's latest start, and when placing is given up
    outcome: dict[str, Any]
    attempts: list[dict[str, Any]] = field(default_factory=list)


class MarketRetrainer:
    """Places one funded retraining demand on the market per call of `submit` (the watcher's interface:
    `policy()`, `traffic()`, `submit()`, `min_logged`)."""

    def __init__(self, spec_path: Path, export_dir: Path, request_log: RequestLog, client: MarketClient,
                 budget: MaintenanceBudget, *, max_price: int | None = None, deadline_s: int = DEFAULT_DEADLINE_S,
                 results_to: str | None = None, export_url: str | None = None, min_logged: int = DEFAULT_MIN_LOGGED,
                 backoff_s: float = BACKOFF_S, backoff_max_s: float = BACKOFF_MAX_S, env_lock: bool = True):
        if request_log is None:
            raise ServeConfigError("--retrain-spec needs --log-requests: a retraining on drift learns from the "
                                   "logged traffic")
        if min_logged < 0:
            raise ServeConfigError(f"--retrain-min-logged must be >= 0, got {min_logged}")
        if deadline_s < 1:
            raise ServeConfigError(f"--retrain-deadline-s must be at least 1, got {deadline_s}")
        self.spec_path, self.export_dir = Path(spec_path), Path(export_dir)
        self.base = read_spec_mapping(self.spec_path)
        self.request_log, self.client, self.budget = request_log, client, budget
        self.min_logged, self.deadline_s = min_logged, deadline_s
        self.backoff_s, self.backoff_max_s = backoff_s, backoff_max_s
        self.specs_dir = request_log.directory.parent / SPECS_DIR
        self.results_to = results_to or str((request_log.directory.parent / RESULTS_DIR).resolve())
        self.traffic_source = SourceSpec(**request_log.source())
        self.data = DataSpec(**self.base["data"])
        self.init_export = init_export_for(self.export_dir, export_url)
        # Without it the provider runs the retraining in its own environment (faster; versions may differ).
        self.env_lock = env_lock_of(self.export_dir) if env_lock else None
        # The job as it would be placed now, with a placeholder for the traffic: refused here, not at drift.
        sample = self._build("check", traffic=False)
        check_runnable(sample.job)
        self.requirement = spec_requirement(sample.job["spec"])
        devices, duration = self.requirement["device_count"], self.requirement["duration_s"]
        self.max_price = max_price if max_price is not None else budget.amount * 3600 // (devices * duration)
        if self.max_price < 1:
            raise ServeConfigError(f"--budget {budget.amount} cannot pay for the retraining's requirement ({devices} "
                                   f"device(s) for {duration}s) at any price of at least 1 per device-hour")
        self.escrow = cost(self.max_price, devices, duration)
        if self.escrow > budget.amount:
            raise ServeConfigError(f"--max-price {self.max_price}: one retraining's escrow ({self.escrow} = max price x "
                                   f"{devices} device(s) x {duration}s) is more than the whole --budget {budget.amount}")
        self._pending: Placement | None = None

    def policy(self) -> dict[str, Any]:
        """What a retraining will place, for /v1/drift: the market, the demand's terms, the budget."""
        return {
            "via": "market",
            "market": self.client.base_url,
            "min_logged_records": self.min_logged,
            "traffic_source": self.traffic_source.path,
            "traffic_filters": {k: v for k, v in self.traffic_source.filters.model_dump(mode="json").items()
                                if v is not None},
            "requirement": self.requirement,
            "max_price_per_device_hour": self.max_price,
            "escrow_per_retraining": self.escrow,
            "deadline_s": self.deadline_s,
            "results_to": self.results_to,
            "init_export": {"uploaded": sorted(self.init_export.get("export_files") or {}),
                            "fetched": sorted(self.init_export.get("export_urls") or {})},
            "env_lock": self.env_lock is not None,
            "budget": self.budget.status(time.time()),
        }

    def traffic(self) -> dict[str, Any]:
        """The sealed log as the retraining would use it (serve/retrain.py's usable_traffic)."""
        return usable_traffic(self.request_log.directory, self.traffic_source, self.data)

    def _build(self, name: str, traffic: bool = True) -> RetrainJob:
        return build_job(self.base, name, self.request_log.source(),
                         self.request_log.directory if traffic else None, self.export_dir, self.init_export,
                         f"{self.results_to.rstrip('/')}/{name}", self.env_lock, Path.cwd())

    def submit(self) -> dict[str, Any]:
        """Decide, charge and place one retraining demand (or go on placing the one decided before);
        returns the placed demand's record. RetrainRefused: too few usable logged records;
        RetrainOverBudget: its escrow is past the period's budget; RetrainDeferred: the market could
        not be reached, tried again later; RetrainError: refused by the market, or given up."""
        if self._pending is None:
            self._pending = self._decide()
        return self._attempt(self._pending)

    @property
    def placing(self) -> bool:
        """Whether a decided demand is still being placed."""
        return self._pending is not None

    def _decide(self) -> Placement:
        self.request_log.seal()  # the job carries complete segments only
        traffic = self.traffic()
        reason = refusal_reason(traffic, self.min_logged)
        if reason is not None:
            raise RetrainRefused(reason, traffic)
        now = time.time()
        name = retraining_name(str(self.base.get('name', 'model')), now)
        built = self._build(name)
        self.specs_dir.mkdir(parents=True, exist_ok=True)
        spec_path = self.specs_dir / f"{name}.yaml"
        atomic_write_text(spec_path, built.job["spec"])
        key = f"{name}-{uuid.uuid4().hex[:12]}"
        deadline = int(now) + self.deadline_s
        self.budget.charge(key, self.escrow, now, name=name, state="deciding")  # RetrainOverBudget past it
        outcome = {"submitted": False, "via": "market", "spec": str(spec_path), "escrow": self.escrow,
                   "max_price_per_device_hour": self.max_price, "latest_start": _iso(deadline),
                   "records_carried": built.records_carried, "traffic_bytes": built.traffic_bytes,
                   "traffic": traffic}
        requirement = {**self.requirement, "latest_start": _iso(deadline)}
        return Placement(key, name, built.job, requirement, self.escrow, deadline, outcome)

    def _attempt(self, placing: Placement) -> dict[str, Any]:
        now = time.time()
        try:
            placed = self.client.place_demand(placing.requirement, self.max_price, idempotency_key=placing.key,
                                              job=placing.job)
        except MarketClientError as exc:
            placing.attempts.append({"at": _iso(now), "error": str(exc)[:500]})
            outcome = {**placing.outcome, "attempts": list(placing.attempts)}
            if 0 < exc.status < 500:  # the market refused it: nothing was reserved
                self._pending = None
                self.budget.release(placing.key)
                raise RetrainError(f"the market refused the retraining demand: {exc}", outcome) from None
            retry_in = min(self.backoff_max_s, self.backoff_s * 2 ** (len(placing.attempts) - 1))
            if now + retry_in >= placing.deadline:
                self._pending = None
                self.budget.note(placing.key, state="given_up")
                raise RetrainError(f"gave up placing the retraining demand after {len(placing.attempts)} attempts: "
                                   f"its deadline {_iso(placing.deadline)} comes before the next; last: {exc}",
                                   outcome) from None
            log.warning("drift: the market could not take the retraining demand (attempt %d): %s; trying again in "
                        "%.1fs", len(placing.attempts), exc, retry_in)
            outcome.update(placing=True, next_attempt_at=_iso(now + retry_in))
            raise RetrainDeferred(f"the market could not be reached: {exc}", outcome, retry_in) from None
        self._pending = None
        placing.attempts.append({"at": _iso(now), "demand_id": placed["id"]})
        self.budget.note(placing.key, state="placed", demand_id=placed["id"])
        log.warning("drift: placed retraining demand %s on %s (escrow %d, max price %d per device-hour, start by %s)",
                    placed["id"], self.client.base_url, placing.escrow, self.max_price, placing.outcome["latest_start"])
        return {**placing.outcome, "submitted": True, "demand_id": placed["id"], "demand_state": placed["state"],
                "lease_id": placed.get("lease_id"), "attempts": list(placing.attempts),
                "budget": self.budget.status(now)}


def spec_requirement(spec_text: str) -> dict[str, Any]:
    """The retraining spec's `resources.requirement`, as a demand states it (without latest_start)."""
    requirement = parse_spec(yaml.safe_load(spec_text), "the retraining spec").resources.requirement
    return requirement.model_dump(mode="json", exclude={"latest_start"})
