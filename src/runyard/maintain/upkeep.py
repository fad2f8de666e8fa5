"""`runyard maintain`: the tenant's upkeep of a model served on a standing lease.

Every `poll_s` the maintainer takes one step:

1. **drift**: it reads the served model's drift events through the lease's endpoint (`/v1/drift`;
   the server on the provider's machine judges drift on its own traffic). A new event is a drift
   episode (the server re-arms only once drift clears). For a new episode, while no retraining is
   under way, it mirrors the logged traffic (`/v1/traffic`, PII-scrubbed at the source) and places one
   funded block demand for the retraining (runyard.serve.retrain_market: the retraining spec plus the
   traffic, `model.init` from the export serving now, the run's environment lock, a maximum price and
   a deadline), its escrow charged to the maintenance budget of the period. One episode buys at most
   one retraining; an episode that starts while one is under way is recorded and buys nothing; one
   past the budget is recorded with the budget's figures (runyard.serve.retrain_budget: an escrow
   stays counted in its period whatever the demand then does). A market that cannot be reached is tried
   again with backoff (the same demand, the same idempotency key).
2. **delivery**: a placed retraining is followed on the market. When its results arrive (the
   provider's delivery marker in `results/<name>/`) its lease is ended (the work is done: it settles
   now, not at its window's end), and when its evaluation says fit to ship, it asks the
   market to roll the new export out on the lease (runyard.market.rollouts; the provider switches
   without a failed request); not fit to ship, or a failed job, is recorded and nothing changes. A
   demand that expires unmatched gets its escrow back from the market.
3. **roll-out**: once the provider reports the switch, the new export is the one serving and the base
   of the next retraining; a failed switch (the new model did not answer) leaves the old one serving,
   and says why.

Everything is kept in `STATE_DIR/maintain.json` (written atomically after every change), so a
maintainer killed at any point and started again goes on where it was, never placing a second demand
for an episode it has already paid for.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runyard.control.delivery import DELIVERY_MARKER
from runyard.maintain.endpoint_client import EndpointClient, EndpointError
from runyard.market.client import MarketClient, MarketClientError
from runyard.market.jobs import init_export_body
from runyard.serve.errors import RetrainDeferred, RetrainError, RetrainOverBudget, RetrainRefused
from runyard.serve.request_log import RequestLog
from runyard.serve.retrain import DEFAULT_MIN_LOGGED
from runyard.serve.retrain_budget import MaintenanceBudget
from runyard.serve.retrain_market import DEFAULT_DEADLINE_S, MarketRetrainer
from runyard.system.files import atomic_write_text

log = logging.getLogger("runyard.maintain")
STATE_FILE = "maintain.json"
UNDER_WAY = ("placing", "placed", "rolling_out")


@dataclass(frozen=True)
class Policy:
    """What the tenant decided once: what to retrain, with how much, and where results land."""

    lease_id: int
    retrain_spec: Path
    budget: int  # minor units per budget period
    budget_period_s: int = 86_400
    max_price: int | None = None
    deadline_s: int = DEFAULT_DEADLINE_S
    min_logged: int = DEFAULT_MIN_LOGGED
    # Where the tenant publishes files the provider fetches (an object store, a file server): exports under
    # `publish_root` are sent as their URLs under `publish_url` rather than uploaded (256 KiB in all).
    publish_root: Path | None = None
    publish_url: str | None = None
    env_lock: bool = True  # carry the served model's run's environment lock (the provider rebuilds it)

    def url_of(self, export: Path) -> str | None:
        """The URL the provider fetches `export`'s files under, or None when it is not published."""
        if self.publish_root is None or self.publish_url is None:
            return None
        try:
            rel = Path(export).resolve().relative_to(Path(self.publish_root).resolve())
        except ValueError:
            return None
        return f"{self.publish_url.rstrip('/')}/{rel.as_posix()}"

    def export_body(self, export: Path) -> dict[str, Any]:
        """An export as a roll-out carries it: its files' URLs when published, else the files uploaded."""
        base = self.url_of(export)
        if base is None:
            return init_export_body(export)
        names = sorted(p.relative_to(export).as_posix() for p in Path(export).rglob("*") if p.is_file())
        return init_export_body(None, {name: f"{base}/{name}" for name in names})


def episode_key(event: dict[str, Any]) -> str:
    """An event's identity across polls: when it happened and at which request."""
    return f"{event.get('time')}#{event.get('requests_seen')}"


class Maintainer:
    """One lease's upkeep (see the module docstring); `step()` does one round."""

    def __init__(self, policy: Policy, state_dir: Path, client: MarketClient, endpoint: EndpointClient,
                 first_export: Path):
        self.policy, self.client, self.endpoint = policy, client, endpoint
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.state_path = self.state_dir / STATE_FILE
        self.state = self._load(first_export)
        self.traffic = RequestLog(self.state_dir / "traffic")
        self.budget = MaintenanceBudget(self.state_dir / "budget.json", policy.budget, policy.budget_period_s)
        self._retrainer: MarketRetrainer | None = None
        self._retry_at = 0.0

    # -- state -----------------------------------------------------------------------------------------

    def _load(self, first_export: Path) -> dict[str, Any]:
        if self.state_path.is_file():
            state = json.loads(self.state_path.read_text(encoding="utf-8"))
            if state.get("lease_id") != self.policy.lease_id:
                raise RetrainError(f"{self.state_path} keeps lease {state.get('lease_id')}'s upkeep, not lease "
                                   f"{self.policy.lease_id}'s; give another --state-dir")
            return state
        return {"lease_id": self.policy.lease_id, "serving_export": str(Path(first_export).resolve()),
                "episodes": [], "retrainings": []}

    def save(self) -> None:
        atomic_write_text(self.state_path, json.dumps(self.state, indent=1))

    def retrainer(self) -> MarketRetrainer:
        """The retrainer for the export serving now (made again after a roll-out)."""
        export = Path(self.state["serving_export"])
        if self._retrainer is None or self._retrainer.export_dir != export:
            self._retrainer = MarketRetrainer(
                self.policy.retrain_spec, export, self.traffic, self.client, self.budget,
                max_price=self.policy.max_price, deadline_s=self.policy.deadline_s,
                results_to=str((self.state_dir / "results").resolve()), export_url=self.policy.url_of(export),
                min_logged=self.policy.min_logged, env_lock=self.policy.env_lock)
        return self._retrainer

    # -- one round ---------------------------------------------------------------------------------------

    def step(self) -> None:
        try:
            self._drift()
        except EndpointError as exc:
            log.warning("lease %s: the endpoint did not answer: %s", self.policy.lease_id, exc)
        for retraining in self.state["retrainings"]:
            try:
                self._follow(retraining)
            except MarketClientError as exc:
                log.warning("lease %s: the market did not answer about %s: %s", self.policy.lease_id,
                            retraining["name"], exc)

    def _drift(self) -> None:
        status = self.endpoint.drift()
        seen = {e["key"] for e in self.state["episodes"]}
        for event in status.get("events", []):
            key = episode_key(event)
            if key in seen:
                continue
            seen.add(key)
            busy = [r["name"] for r in self.state["retrainings"] if r["state"] in UNDER_WAY]
            episode = {"key": key, "time": event.get("time"), "token_js": event.get("token_js"),
                       "outcome": f"a retraining is under way ({busy[0]})" if busy else "placing"}
            self.state["episodes"].append(episode)
            self.save()
            log.warning("lease %s: drift episode at %s (token JS %s)%s", self.policy.lease_id, episode["time"],
                        episode["token_js"], f"; {episode['outcome']}" if busy else "")
            if not busy:
                self.endpoint.mirror_traffic(self.traffic.directory)
                self._place(episode)
        pending = [e for e in self.state["episodes"] if e["outcome"] == "placing"]
        if pending and time.monotonic() >= self._retry_at:
            self._place(pending[-1])

    def _place(self, episode: dict[str, Any]) -> None:
        try:
            placed = self.retrainer().submit()
        except RetrainDeferred as exc:
            self._retry_at = time.monotonic() + exc.retry_in_s
            episode["attempts"] = exc.outcome.get("attempts", [])
            self.save()
            return
        except (RetrainRefused, RetrainOverBudget, RetrainError) as exc:
            episode["outcome"] = f"not placed: {exc}"
            if isinstance(exc, RetrainOverBudget):
                episode["budget"] = exc.budget
            self.save()
            log.warning("lease %s: drift episode %s buys no retraining: %s", self.policy.lease_id, episode["key"], exc)
            return
        name = Path(placed["spec"]).stem
        episode["outcome"] = f"placed demand {placed['demand_id']}"
        self.state["retrainings"].append({
            "episode": episode["key"], "name": name, "demand_id": placed["demand_id"], "escrow": placed["escrow"],
            "results": str((self.state_dir / "results" / name).resolve()), "state": "placed", "placed_at": time.time(),
            "from_export": self.state["serving_export"]})
        self.save()
        log.warning("lease %s: drift episode %s placed retraining demand %s (escrow %s)", self.policy.lease_id,
                    episode["key"], placed["demand_id"], placed["escrow"])

    # -- following a retraining ----------------------------------------------------------------------------

    def _follow(self, retraining: dict[str, Any]) -> None:
        if retraining["state"] == "placed":
            self._delivered(retraining)
        elif retraining["state"] == "rolling_out":
            self._rolled_out(retraining)

    def _delivered(self, retraining: dict[str, Any]) -> None:
        demand = self.client.demand(retraining["demand_id"])
        retraining["lease_id"] = demand.get("lease_id")
        if demand["state"] in ("expired", "cancelled"):
            # The market returned its escrow; the budget keeps it counted (it caps what upkeep may commit).
            self._end(retraining, demand["state"], f"the demand {demand['state']} unmatched; its escrow returned")
            return
        results = Path(retraining["results"])
        marker = results / DELIVERY_MARKER
        if not marker.is_file():
            return
        stamp = json.loads(marker.read_text(encoding="utf-8"))
        self._end_lease(retraining)
        if stamp.get("job_state") != "succeeded":
            self._end(retraining, "failed", f"the retraining job ended {stamp.get('job_state')}")
            return
        report_path = results / "eval" / "report.json"
        report = json.loads(report_path.read_text(encoding="utf-8")) if report_path.is_file() else {}
        if not report.get("fit_to_ship"):
            self._end(retraining, "not_fit", "not fit to ship: " + "; ".join(report.get("reasons") or ["no report"]))
            return
        body = self.policy.export_body(results / "export")
        asked = self.client.request_rollout(self.policy.lease_id, idempotency_key=f"rollout-{retraining['name']}",
                                            **body)
        retraining.update(state="rolling_out", rollout_id=asked["id"])
        self.save()
        log.warning("lease %s: retraining %s is fit to ship; roll-out %s asked", self.policy.lease_id,
                    retraining["name"], asked["id"])

    def _end_lease(self, retraining: dict[str, Any]) -> None:
        """The results are here, the work is done: end the retraining's lease now (usage so far is paid) so
        its capacity returns and it settles, rather than holding it to its window's end."""
        lease_id = retraining.get("lease_id")
        if lease_id is None or retraining.get("lease_ended"):
            return
        try:
            self.client.terminate_lease(lease_id, "tenant_request", "the retraining was delivered",
                                        idempotency_key=f"end-{retraining['name']}")
        except MarketClientError as exc:
            if exc.status != 409:  # 409: it had already ended
                raise
        retraining["lease_ended"] = True
        self.save()

    def _rolled_out(self, retraining: dict[str, Any]) -> None:
        rollout = next((r for r in self.client.rollouts(self.policy.lease_id) if r["id"] == retraining["rollout_id"]),
                       None)
        if rollout is None or rollout["state"] == "requested":
            return
        if rollout["state"] == "switched":
            self.state["serving_export"] = str(Path(retraining["results"]) / "export")
            self._end(retraining, "rolled_out", f"serving {rollout['export_digest']}")
        else:
            self._end(retraining, "rollout_failed", f"the roll-out {rollout['state']}: {rollout.get('detail')}")

    def _end(self, retraining: dict[str, Any], state: str, detail: str) -> None:
        retraining.update(state=state, detail=detail, ended_at=time.time())
        self.save()
        log.warning("lease %s: retraining %s: %s", self.policy.lease_id, retraining["name"], detail)
