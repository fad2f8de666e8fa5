"""Revocation ends trading: what happens to a verified account's business when an operator revokes
its verification (identity verified -> rejected), and the operator's decision on a revoked
provider's held earnings.

All of it runs in the revocation's own write transaction, after the account's state has changed
(so matching, which joins on the account's state, already leaves the account out). The rules:

  provider  offered and accepted leases are cancelled (end reason `provider_revoked`), their escrow
            returned; each demand is open again with a fresh hold, as for any lease that ends before
            it starts. Running leases are terminated at the revocation itself (the boundary is the
            revocation: `window_end` becomes its time, a standing lease's period ends there). Only
            usage and availability records the market received before the revocation are billable:
            a provider that is not verified can report nothing (403 `not_verified`), so nothing after
            it is. Every lease of the provider not yet settled is marked `earnings_hold = "held"`: its
            settlement runs as usual (the tenant may still acknowledge, dispute and measure) but pays
            the provider's share into the lease's held account, where it waits for the operator.
  tenant    offered and accepted leases are cancelled (end reason `tenant_revoked`) and every open
            demand is cancelled, each hold released in full. Running leases run to their end and
            settle as usual: the provider served them in good faith.

Listings are left as they are; they match nothing while their provider is not verified. The
operator's decision (`decide_held`) moves a settled lease's held earnings to the provider's earnings
("release") or back to the tenant ("refund"). Every change is recorded with its actor, time and
reason: the lease and demand transitions through their machines, the hold as transitions of the
entity `earnings_hold` (none -> held -> released | refunded), and audit rows.
"""

from __future__ import annotations

from sqlalchemy import Connection, select, update

from runyard.market import escrow, ledger, periods
from runyard.market.errors import Conflict
from runyard.market.leases import end_before_start
from runyard.market.matcher import release_capacity
from runyard.market.models import HeldDecisionIn
from runyard.market.rows import lock_demand, lock_lease
from runyard.market.schema import demands, leases, transitions
from runyard.market.service import Market, Principal, audit
from runyard.market.states import Actor, transition
from runyard.market.states.demand import CANCELLED as DEMAND_CANCELLED
from runyard.market.states.demand import DEMAND
from runyard.market.states.demand import OPEN as DEMAND_OPEN
from runyard.market.states.lease import (
    ACCEPTED,
    CANCELLED,
    LEASE,
    OFFERED,
    RUNNING,
    SETTLED,
    TERMINATED,
    WINDOW_CLOSED,
)

HELD, RELEASED, REFUNDED = "held", "released", "refunded"
HOLD_ENTITY = "earnings_hold"


def _ids(conn: Connection, *where) -> list[int]:  # type: ignore[no-untyped-def]
    return list(conn.execute(select(leases.c.id).where(*where).order_by(leases.c.id)).scalars())


def _hold_transition(conn: Connection, lease_id: int, to: str, actor: Actor, reason: str, now: int,
                     before: str | None) -> None:
    conn.execute(update(leases).where(leases.c.id == lease_id).values(earnings_hold=to))
    conn.execute(transitions.insert().values(entity=HOLD_ENTITY, entity_id=lease_id, from_state=before, to_state=to,
                                             actor=str(actor), reason=reason, at=now))


def end_trading(conn: Connection, account_id: int, role: str, actor: Actor, reason: str, now: int) -> dict:
    """Apply the module docstring's rules to a just-revoked account; returns what was done, by kind."""
    done = {"leases_cancelled": 0, "leases_terminated": 0, "earnings_held": 0, "demands_cancelled": 0}
    side = "provider" if role == "provider" else "tenant"
    code = f"{side}_revoked"
    if role not in ("tenant", "provider"):
        return done
    party = leases.c.provider_id if role == "provider" else leases.c.tenant_id
    for lease_id in _ids(conn, party == account_id, leases.c.state.in_((OFFERED, ACCEPTED))):
        lease = lock_lease(conn, lease_id, None)
        if lease["state"] in (OFFERED, ACCEPTED):
            end_before_start(conn, lease, CANCELLED, actor, code, now, f"{side} {account_id} revoked: {reason}")
            done["leases_cancelled"] += 1
    if role == "provider":
        for lease_id in _ids(conn, party == account_id, leases.c.state == RUNNING):
            lease = lock_lease(conn, lease_id, None)
            transition(conn, LEASE, lease_id, TERMINATED, actor, f"{code}: {reason}", now, expect=RUNNING,
                       end_reason=code, window_end=min(now, lease["window_end"] or now))
            if lease["form"] == "standing":
                periods.end_inside(conn, lease_id, now)
            release_capacity(conn, lease, now)
            audit(conn, actor, "lease.terminate", f"lease:{lease_id}", now, reason=code)
            done["leases_terminated"] += 1
        unsettled = (RUNNING, WINDOW_CLOSED, TERMINATED)
        for lease_id in _ids(conn, party == account_id, leases.c.state.in_(unsettled), leases.c.earnings_hold.is_(None)):
            _hold_transition(conn, lease_id, HELD, actor, f"provider {account_id} revoked: {reason}", now, None)
            audit(conn, actor, "lease.earnings_held", f"lease:{lease_id}", now, reason=reason)
            done["earnings_held"] += 1
    else:
        # After the leases: a demand whose lease was just cancelled is open again, and ends here too.
        open_ids = conn.execute(select(demands.c.id).where(demands.c.tenant_id == account_id,
                                                           demands.c.state == DEMAND_OPEN)).scalars().all()
        for demand_id in open_ids:
            demand = lock_demand(conn, demand_id)
            if demand is None or demand["state"] != DEMAND_OPEN:
                continue
            transition(conn, DEMAND, demand_id, DEMAND_CANCELLED, actor, f"{code}: {reason}", now, expect=DEMAND_OPEN)
            escrow.release(conn, demand["escrow_pending_id"], actor, now)
            audit(conn, actor, "demand.cancel", f"demand:{demand_id}", now, reason=code)
            done["demands_cancelled"] += 1
    audit(conn, actor, "account.trading_ended", f"account:{account_id}", now, reason=reason, **done)
    return done


def decide_held(market: Market, principal: Principal, lease_id: int, body: HeldDecisionIn, key: str | None) -> dict:
    """The operator's decision on a settled lease's held earnings: release them to the provider's
    earnings, or refund them to the tenant's available balance (idempotent on `key`)."""
    principal.require_role("operator")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("decide on held earnings", conn)
        lease = lock_lease(conn, lease_id, principal)
        if lease["earnings_hold"] != HELD:
            state = lease["earnings_hold"] or "not held"
            raise Conflict(f"lease {lease_id}'s earnings are {state}; only held earnings await a decision",
                           lease=lease_id, earnings_hold=lease["earnings_hold"])
        if lease["state"] != SETTLED:
            raise Conflict(f"lease {lease_id} is {lease['state']}; its held earnings are decided once it has "
                           "settled (its reports closed and nothing disputed), when no more can arrive",
                           lease=lease_id, state=lease["state"])
        held = ledger.open_account(conn, escrow.held_code(lease_id), "held_earnings", lease["provider_id"])
        amount = ledger.balance(conn, held).available
        if body.decision == "release":
            to, code, why = ledger.account_id(conn, f"provider:{lease['provider_id']}:earnings"), RELEASED, "held_release"
        else:
            to, code, why = escrow.tenant_account(conn, lease["tenant_id"]), REFUNDED, "held_refund"
        if amount:
            ledger.transfer(conn, held, to, amount, reason=why, actor=str(principal.actor), now=now, lease_id=lease_id)
        _hold_transition(conn, lease_id, code, principal.actor, body.reason, now, HELD)
        audit(conn, principal.actor, f"lease.earnings_{code}", f"lease:{lease_id}", now, amount=amount,
              reason=body.reason)
        return {"lease_id": lease_id, "earnings_hold": code, "amount": amount,
                "to": ledger.balance(conn, to).code}

    return market.idempotent(principal, key, "lease.held_earnings", {"lease_id": lease_id, **body.model_dump()}, tx)

