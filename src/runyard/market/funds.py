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
    ledger.check_amount(amount)

    def tx(conn: Connection, now: int) -> dict:
        target = _own_account(conn, principal)
        transfer_id = ledger.transfer(
            conn, ledger.account_id(conn, ledger.EXTERNAL_DEPOSITS), target, amount,
            reason="deposit", actor=str(principal.actor), now=now,
        )  # fmt: skip
        audit(conn, principal.actor, "funds.deposit", f"account:{principal.id}", now, amount=amount)
        return {
            "transfer_id": transfer_id,
            "amount": amount,
            "balance": ledger.balance(conn, target).to_json(),
        }

    return market.idempotent(principal, key, "funds.deposit", {"amount": amount}, tx)


def withdraw(market: Market, principal: Principal, amount: int, key: str | None) -> dict:
    """Pay out of the market: a tenant's available balance or a provider's earnings."""
    principal.require_role("tenant", "provider")
    ledger.check_amount(amount)

    def tx(conn: Connection, now: int) -> dict:
        source = _own_account(conn, principal)
        transfer_id = ledger.transfer(
            conn, source, ledger.account_id(conn, ledger.EXTERNAL_WITHDRAWALS), amount,
            reason="withdrawal", actor=str(principal.actor), now=now,
        )  # fmt: skip
        audit(conn, principal.actor, "funds.withdraw", f"account:{principal.id}", now, amount=amount)
        return {
            "transfer_id": transfer_id,
            "amount": amount,
            "balance": ledger.balance(conn, source).to_json(),
        }

    return market.idempotent(principal, key, "funds.withdraw", {"amount": amount}, tx)


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
