"""Escrow: the tenant's money held for a demand and then for its lease, in one place.

  reserve   a demand's hold: max price x devices x duration, pending from the tenant's available
            balance to the demand's escrow account (placing a demand, or reopening one)
  release   void a demand's hold in full (cancelled, expired, refused)
  fund      post the hold at the listing's price when a lease is made; the rest goes back at once
  pay       move accepted charges out of a lease's escrow to the provider and the market's fees
  refund    return whatever is left in a lease's escrow to the tenant
  give_back return part of a standing lease's escrow to the tenant: a period's rest, or its credit
  top_up    fund a standing lease's renewed period from the tenant's available balance

A lease whose provider was revoked (`earnings_hold` set) pays the provider's share into the lease's
held account (`held_code`) instead of the provider's earnings; the operator releases or refunds it.

Leases, matching and settlement call these; this module calls only the ledger, so nothing above
it is ever called back.
"""

from __future__ import annotations

from sqlalchemy import Connection, func, select, update

from runyard.market import ledger
from runyard.market.errors import EscrowShort
from runyard.market.schema import leases, ledger_accounts
from runyard.market.states import Actor


def tenant_account(conn: Connection, tenant_id: int) -> int:
    return ledger.account_id(conn, f"tenant:{tenant_id}:available")


def _escrow_code(conn: Connection, demand_id: int) -> str:
    """`escrow:demand:<id>` for a demand's first hold, `escrow:demand:<id>:<n>` when it reopens,
    so that every lease has an escrow account of its own."""
    prefix = f"escrow:demand:{demand_id}"
    taken = conn.execute(
        select(func.count()).where(
            (ledger_accounts.c.code == prefix) | ledger_accounts.c.code.like(prefix + ":%")
        )
    ).scalar_one()
    return prefix if taken == 0 else f"{prefix}:{taken + 1}"


def shortfall(conn: Connection, tenant_id: int, amount: int) -> int:
    """How much more the tenant's available balance needs to hold `amount` (0 when it can)."""
    return max(0, amount - ledger.balance(conn, tenant_account(conn, tenant_id)).available)


def reserve(
    conn: Connection, demand_id: int, tenant_id: int, amount: int, actor: Actor, now: int
) -> tuple[int, int]:
    """Hold `amount` of the tenant's available balance for a demand. Returns (escrow account,
    pending transfer id); InsufficientFunds when the tenant cannot cover it."""
    ledger.check_amount(amount, "escrow (max price x devices x duration)")
    escrow_id = ledger.open_account(conn, _escrow_code(conn, demand_id), "escrow", tenant_id)
    pending_id = ledger.transfer(
        conn, tenant_account(conn, tenant_id), escrow_id, amount,
        reason="escrow_reserve", actor=str(actor), now=now, pending=True, demand_id=demand_id,
    )  # fmt: skip
    return escrow_id, pending_id


def release(conn: Connection, pending_id: int, actor: Actor | str, now: int) -> None:
    """Void a demand's hold: every unit goes back to the tenant's available balance."""
    ledger.void_pending(conn, pending_id, reason="escrow_release", actor=str(actor), now=now)


def fund(conn: Connection, pending_id: int, amount: int, lease_id: int, now: int) -> None:
    """Post a demand's hold for `amount` (the listing's price) into its escrow for the lease."""
    ledger.post_pending(
        conn, pending_id, amount, reason="escrow_fund", actor="system", now=now, lease_id=lease_id
    )


def held_code(lease_id: int) -> str:
    return f"held:lease:{lease_id}"


def provider_account(conn: Connection, lease: dict) -> int:
    """Where a lease's provider share goes: its earnings, or its held account when the provider's
    verification was revoked before the lease settled."""
    if lease.get("earnings_hold"):
        return ledger.open_account(conn, held_code(lease["id"]), "held_earnings", lease["provider_id"])
    return ledger.account_id(conn, f"provider:{lease['provider_id']}:earnings")


def available(conn: Connection, lease: dict) -> int:
    """What a lease's escrow still holds."""
    return ledger.balance(conn, lease["escrow_account_id"]).available


def pay(conn: Connection, lease: dict, to_provider: int, to_fees: int, actor: Actor, now: int) -> None:
    """Pay a lease's provider and the market's fees out of its escrow (EscrowShort if it cannot)."""
    if to_provider + to_fees > available(conn, lease):
        raise EscrowShort(
            f"lease {lease['id']} would pay {to_provider + to_fees} from an escrow holding {available(conn, lease)}",
            lease=lease["id"],
        )
    escrow = lease["escrow_account_id"]
    if to_provider:
        earnings = provider_account(conn, lease)
        ledger.transfer(
            conn,
            escrow,
            earnings,
            to_provider,
            reason="settle_provider",
            actor=str(actor),
            now=now,
            lease_id=lease["id"],
        )
    if to_fees:
        fees = ledger.account_id(conn, ledger.MARKET_FEES)
        ledger.transfer(
            conn, escrow, fees, to_fees, reason="settle_fee", actor=str(actor), now=now, lease_id=lease["id"]
        )


def refund(conn: Connection, lease: dict, actor: Actor | str, now: int) -> int:
    """Return whatever is left in the lease's escrow to the tenant. Returns the amount moved."""
    remaining = available(conn, lease)
    if remaining > 0:
        ledger.transfer(
            conn, lease["escrow_account_id"], tenant_account(conn, lease["tenant_id"]), remaining,
            reason="escrow_refund", actor=str(actor), now=now, lease_id=lease["id"],
        )  # fmt: skip
        conn.execute(
            update(leases).where(leases.c.id == lease["id"]).values(refunded=leases.c.refunded + remaining)
        )
    return remaining


def give_back(conn: Connection, lease: dict, amount: int, reason: str, column: str, actor: Actor | str,
              now: int) -> None:
    """Return `amount` of a lease's escrow to its tenant (reason "escrow_refund" for a period's rest,
    "sla_credit" for a credit), counted in the lease's `column` ("refunded" or "credited")."""
    if amount <= 0:
        return
    if amount > available(conn, lease):
        raise EscrowShort(f"lease {lease['id']} would return {amount} from an escrow holding {available(conn, lease)}",
                          lease=lease["id"])
    ledger.transfer(conn, lease["escrow_account_id"], tenant_account(conn, lease["tenant_id"]), amount,
                    reason=reason, actor=str(actor), now=now, lease_id=lease["id"])
    conn.execute(update(leases).where(leases.c.id == lease["id"]).values({column: leases.c[column] + amount}))


def top_up(conn: Connection, lease: dict, amount: int, actor: Actor | str, now: int) -> None:
    """Move `amount` from the tenant's available balance into the lease's escrow (a renewed period);
    InsufficientFunds when the tenant cannot cover it."""
    ledger.transfer(conn, tenant_account(conn, lease["tenant_id"]), lease["escrow_account_id"], amount,
                    reason="renewal_fund", actor=str(actor), now=now, lease_id=lease["id"])
    conn.execute(update(leases).where(leases.c.id == lease["id"])
                 .values(escrow_amount=leases.c.escrow_amount + amount))
