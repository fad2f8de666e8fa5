"""Money in and out: deposits (tenants), withdrawals (tenants from what is available, providers from
earnings), and balances. Each movement is one idempotent ledger transfer."""

from __future__ import annotations

from sqlalchemy import Connection, select

from runyard.market import ledger
from runyard.market.schema import ledger_accounts
from runyard.market.service import Market, Principal, audit


def _own_account(conn: Connection, principal: Principal) -> int:
    code = (
        f"tenant:{principal.id}:available"
        if principal.role == "tenant"
        else f"provider:{principal.id}:earnings"
    )
    return ledger.account_id(conn, code)


def deposit(market: Market, principal: Principal, amount: int, key: str | None) -> dict:
    """Credit a tenant's available balance from outside the market."""
    principal.require_role("tenant")
    return _move(market, principal, amount, key, "funds.deposit", inbound=True)


def withdraw(market: Market, principal: Principal, amount: int, key: str | None) -> dict:
    """Pay out of the market: a tenant's available balance or a provider's earnings."""
    principal.require_role("tenant", "provider")
    return _move(market, principal, amount, key, "funds.withdraw", inbound=False)


def _move(
    market: Market, principal: Principal, amount: int, key: str | None, operation: str, inbound: bool
) -> dict:
    """One idempotent transfer between the caller's own account and the outside world: in from
    external deposits when `inbound`, else out to external withdrawals."""
    ledger.check_amount(amount)

    def tx(conn: Connection, now: int) -> dict:
        own = _own_account(conn, principal)
        if inbound:
            debit, credit, reason = ledger.account_id(conn, ledger.EXTERNAL_DEPOSITS), own, "deposit"
        else:
            debit, credit, reason = own, ledger.account_id(conn, ledger.EXTERNAL_WITHDRAWALS), "withdrawal"
        transfer_id = ledger.transfer(
            conn, debit, credit, amount, reason=reason, actor=str(principal.actor), now=now
        )
        audit(conn, principal.actor, operation, f"account:{principal.id}", now, amount=amount)
        return {"transfer_id": transfer_id, "amount": amount, "balance": ledger.balance(conn, own).to_json()}

    return market.idempotent(principal, key, operation, {"amount": amount}, tx)


def balances(market: Market, principal: Principal) -> dict:
    """Every ledger account the caller owns (available or earnings, and each escrow)."""

    def tx(conn: Connection, now: int) -> dict:
        rows = conn.execute(
            select(ledger_accounts)
            .where(ledger_accounts.c.owner_id == principal.id)
            .order_by(ledger_accounts.c.id)
        ).mappings()
        out = [
            ledger.Balance(
                r["code"], r["debits_pending"], r["debits_posted"], r["credits_pending"], r["credits_posted"]
            ).to_json()
            for r in rows
        ]
        return {"currency": Market.config(conn)["currency"], "accounts": out}

    return market.read(tx)
