"""Roll-outs of a standing lease: the tenant asks its provider to serve another export on the same
lease and endpoint, or to roll back to the one served before; the provider says how it ended.

The market carries the request; the provider's agent does the switch (runyard.control.agent_rollout:
the new server beside the old one, health-checked, the endpoint moved, the old one drained) and
reports `switched` (with the digest of the export now serving) or `failed` (the old export keeps
serving; the provider's words say why). Nothing here moves money: a roll-out changes what a lease
serves, not what it costs.

Rules: only the tenant asks, only for its running standing lease, one requested roll-out at a time
(409 otherwise); only the provider reports. A roll-back is resolved here, so both sides agree on
its target: the exports served so far are the deployment's own, then each switched roll-out's, and
a roll-back returns to the one before the export serving now (a second roll-back returns to what
the first undid). Each roll-out stores the export it asks for, so the provider needs no history of
its own to serve a roll-back.
"""

from __future__ import annotations

import json

from sqlalchemy import Connection, func, select

from runyard.market.errors import Conflict, NotFound
from runyard.market.rows import is_party, lock_lease_as
from runyard.market.schema import demands, leases, rollouts
from runyard.market.service import Market, Principal, audit
from runyard.market.serving import RolloutIn, RolloutOutcomeIn, deployment_of, deployment_sha256
from runyard.market.states import record_initial, transition
from runyard.market.states.lease import RUNNING
from runyard.market.states.rollout import FAILED, REQUESTED, ROLLOUT, SWITCHED, WITHDRAWN


def rollout_json(row, party: bool) -> dict:  # type: ignore[no-untyped-def]
    out = dict(row)
    out["export"] = json.loads(row["export"]) if party and row["export"] is not None else None
    return out


def _export_of(body: RolloutIn | dict) -> dict:
    data = body.model_dump(mode="json") if isinstance(body, RolloutIn) else body
    return {"export_files": data.get("export_files") or {}, "export_urls": data.get("export_urls") or {}}


def served_exports(conn: Connection, lease: dict) -> list[dict]:
    """The exports the lease has served, oldest first: the deployment's, then each switched roll-out's."""
    deployment = deployment_of(conn.execute(select(demands.c.deployment).where(
        demands.c.id == lease["demand_id"])).scalar_one())
    served = [_export_of(deployment or {})]
    for text in conn.execute(select(rollouts.c.export).where(rollouts.c.lease_id == lease["id"],
                                                              rollouts.c.state == SWITCHED)
                             .order_by(rollouts.c.seq)).scalars():
        served.append(json.loads(text))
    return served


def request_rollout(market: Market, principal: Principal, lease_id: int, body: RolloutIn, key: str | None) -> dict:
    """The tenant asks its running standing lease to serve another export, or the one before."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        lease = lock_lease_as(conn, lease_id, principal, "tenant")
        if lease["form"] != "standing":
            raise Conflict(f"lease {lease_id} is a block lease; only a standing lease serves an export to roll out")
        if lease["state"] != RUNNING:
            raise Conflict(f"lease {lease_id} is {lease['state']}; a roll-out is asked of a running lease")
        open_one = conn.execute(select(rollouts.c.id).where(rollouts.c.lease_id == lease_id,
                                                             rollouts.c.state == REQUESTED)).scalar_one_or_none()
        if open_one is not None:
            raise Conflict(f"lease {lease_id} already has roll-out {open_one} requested; wait for it to end or "
                           "withdraw it")
        if body.rollback:
            served = served_exports(conn, lease)
            if len(served) < 2:
                raise Conflict(f"lease {lease_id} still serves its first export: nothing to roll back to")
            export, kind = served[-2], "rollback"
        else:
            export, kind = _export_of(body), "rollout"
        seq = (conn.execute(select(func.max(rollouts.c.seq)).where(rollouts.c.lease_id == lease_id))
               .scalar_one_or_none() or 0) + 1
        rollout_id = conn.execute(rollouts.insert().values(
            lease_id=lease_id, seq=seq, kind=kind, export=json.dumps(export, sort_keys=True, separators=(",", ":")),
            export_sha256=deployment_sha256(export), state=REQUESTED, requested_at=now)).inserted_primary_key[0]
        record_initial(conn, ROLLOUT, rollout_id, principal.actor, kind, now)
        audit(conn, principal.actor, f"lease.{kind}", f"lease:{lease_id}", now, rollout=rollout_id)
        return _reread(conn, rollout_id)

    params = {"lease_id": lease_id, **body.model_dump(mode="json")}
    return market.idempotent(principal, key, "lease.rollout", params, tx)


def list_rollouts(market: Market, principal: Principal, lease_id: int) -> list[dict]:
    """A standing lease's roll-outs, oldest first (the lease's parties and operators)."""
    def tx(conn: Connection, now: int) -> list[dict]:
        row = conn.execute(select(leases.c.tenant_id, leases.c.provider_id).where(leases.c.id == lease_id)
                           ).mappings().one_or_none()
        if row is None or not is_party(principal, row):
            raise NotFound(f"no lease {lease_id} of yours")
        party = principal.role != "operator"
        return [rollout_json(r, party) for r in conn.execute(
            select(rollouts).where(rollouts.c.lease_id == lease_id).order_by(rollouts.c.seq)).mappings()]

    return market.read(tx)


def report_rollout(market: Market, principal: Principal, lease_id: int, rollout_id: int, body: RolloutOutcomeIn,
                   key: str | None) -> dict:
    """The provider says how a requested roll-out ended: switched (the export now serving) or failed."""
    principal.require_role("provider")

    def tx(conn: Connection, now: int) -> dict:
        lock_lease_as(conn, lease_id, principal, "provider")
        _of_lease(conn, lease_id, rollout_id)
        to = SWITCHED if body.switched else FAILED
        transition(conn, ROLLOUT, rollout_id, to, principal.actor, body.detail[:200] or to, now, expect=REQUESTED,
                   finished_at=now, export_digest=body.export_digest, detail=body.detail or None)
        audit(conn, principal.actor, f"rollout.{to}", f"lease:{lease_id}", now, rollout=rollout_id,
              export_digest=body.export_digest)
        return _reread(conn, rollout_id)

    params = {"lease_id": lease_id, "rollout_id": rollout_id, **body.model_dump(mode="json")}
    return market.idempotent(principal, key, "rollout.outcome", params, tx)


def withdraw_rollout(market: Market, principal: Principal, lease_id: int, rollout_id: int, key: str | None) -> dict:
    """The tenant takes back a roll-out the provider has not yet taken up."""
    principal.require_role("tenant")

    def tx(conn: Connection, now: int) -> dict:
        lock_lease_as(conn, lease_id, principal, "tenant")
        _of_lease(conn, lease_id, rollout_id)
        transition(conn, ROLLOUT, rollout_id, WITHDRAWN, principal.actor, "withdrawn by the tenant", now,
                   expect=REQUESTED, finished_at=now)
        audit(conn, principal.actor, "rollout.withdrawn", f"lease:{lease_id}", now, rollout=rollout_id)
        return _reread(conn, rollout_id)

    return market.idempotent(principal, key, "rollout.withdraw", {"lease_id": lease_id, "rollout_id": rollout_id}, tx)


def _of_lease(conn: Connection, lease_id: int, rollout_id: int) -> None:
    owner = conn.execute(select(rollouts.c.lease_id).where(rollouts.c.id == rollout_id)).scalar_one_or_none()
    if owner != lease_id:
        raise NotFound(f"no roll-out {rollout_id} of lease {lease_id}")


def _reread(conn: Connection, rollout_id: int) -> dict:
    return rollout_json(conn.execute(select(rollouts).where(rollouts.c.id == rollout_id)).mappings().one(), True)
