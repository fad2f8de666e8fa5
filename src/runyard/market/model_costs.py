"""What each of a tenant's models has cost: training (block leases) and serving (standing leases),
from what the ledger settled, per model lineage.

A lineage is a model's name as the tenant gave it to the market:
  - a block lease's: the `name` of its job's spec (the run's name), less a retraining's mark: a
    retraining of NAME is named NAME-retrain-STAMP (lineage.py, which runyard's retrainers use), so
    what each retraining cost counts in the lineage of the model it retrains;
  - a standing lease's: its deployment's `serve.model_name`;
  - otherwise "(unnamed)". A tenant that serves under the run's name (runyard serve's default)
    and says so in `serve.model_name` gets its training and serving in one lineage.

Amounts are what has moved, in integer minor units: a lease's or period's `charged` is what was
paid to the provider plus the market fee (statements.py counts it the same way); an SLA credit
returns to the tenant, so it is never charged. A training lease's cost is its settled amounts so
far; a serving period counts once settled (running and closed periods show with charged 0).

`serving_passed_training_at`: walking the lineage's costs in time (a training lease at the end of
its window, a serving period at its end), the first moment cumulative serving exceeded cumulative
training, or None. The market has no energy figures (usage and availability records carry none)
and no forecast (a demand stores the requirement, not the plan that made it), so neither appears.
"""

from __future__ import annotations

import yaml
from sqlalchemy import Connection, select

from runyard.market.lineage import lineage_of
from runyard.market.schema import demands, lease_periods, leases
from runyard.market.service import Market, Principal
from runyard.market.serving import deployment_of

UNNAMED = "(unnamed)"

def _spec_name(spec: str | None) -> str | None:
    if not spec:
        return None
    try:
        data = yaml.safe_load(spec)
    except yaml.YAMLError:  # the market stores any YAML mapping; an unparseable one names nothing
        return None
    name = data.get("name") if isinstance(data, dict) else None
    return str(name) if isinstance(name, str | int) and str(name) else None


def _lineage(row) -> str:  # type: ignore[no-untyped-def]
    if row["form"] == "standing":
        deployment = deployment_of(row["deployment"]) or {}
        name = (deployment.get("serve") or {}).get("model_name")
    else:
        name = _spec_name(row["job_spec"])
        name = lineage_of(name) if name else None
    return name or UNNAMED


def _empty(model: str) -> dict:
    return {"model": model, "training": [], "serving": [], "training_charged": 0, "serving_charged": 0,
            "charged": 0, "serving_passed_training_at": None}


def model_costs(market: Market, principal: Principal) -> dict:
    """The calling tenant's costs per model lineage (its own leases only)."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        config = Market.config(conn)
        rows = conn.execute(
            select(leases, demands.c.job_spec, demands.c.deployment)
            .join(demands, demands.c.id == leases.c.demand_id)
            .where(leases.c.tenant_id == principal.id)
            .order_by(leases.c.id)
        ).mappings().all()
        by_model: dict[str, dict] = {}
        events: dict[str, list[tuple[int, int, str, int]]] = {}  # model -> (at, order, kind, amount)
        for row in rows:
            model = _lineage(row)
            entry = by_model.setdefault(model, _empty(model))
            charged = row["paid_provider"] + row["paid_fee"]
            line = {"lease_id": row["id"], "demand_id": row["demand_id"], "state": row["state"],
                    "devices": row["devices"], "started_at": row["started_at"], "window_end": row["window_end"],
                    "charged": charged, "paid_provider": row["paid_provider"], "fee": row["paid_fee"],
                    "refunded": row["refunded"]}
            if row["form"] == "standing":
                periods = conn.execute(
                    select(lease_periods).where(lease_periods.c.lease_id == row["id"]).order_by(lease_periods.c.seq)
                ).mappings().all()
                line["credited"] = row["credited"]
                line["periods"] = [
                    {"seq": p["seq"], "period_start": p["period_start"], "period_end": p["period_end"],
                     "state": p["state"], "charged": p["paid_provider"] + p["paid_fee"],
                     "paid_provider": p["paid_provider"], "fee": p["paid_fee"], "credit": p["credit"] or 0,
                     "refunded": p["refunded"], "settled_at": p["settled_at"]}
                    for p in periods
                ]
                entry["serving"].append(line)
                entry["serving_charged"] += charged
                for p in line["periods"]:
                    if p["charged"]:
                        events.setdefault(model, []).append((p["period_end"], 1, "serving", p["charged"]))
            else:
                entry["training"].append(line)
                entry["training_charged"] += charged
                if charged:
                    at = row["window_end"] or row["started_at"] or row["created_at"]
                    events.setdefault(model, []).append((at, 0, "training", charged))
            entry["charged"] += charged
        for model, entry in by_model.items():
            entry["serving_passed_training_at"] = _passed(events.get(model, []))
        return {"tenant_id": principal.id, "currency": config["currency"], "now": now,
                "models": [by_model[k] for k in sorted(by_model)],
                "charged": sum(e["charged"] for e in by_model.values())}

    return market.read(tx)


def _passed(events: list[tuple[int, int, str, int]]) -> int | None:
    """The first time cumulative serving exceeded cumulative training (training first at a tie)."""
    training = serving = 0
    for at, _, kind, amount in sorted(events):
        if kind == "training":
            training += amount
        else:
            serving += amount
        if training and serving > training:
            return at
    return None
