"""Money in and out.

In: only through a payment rail (a signed event, applied once per rail event id; see `rails`) or an
operator's credit. Out: a withdrawal to one of the caller's registered payout methods, after these
checks: the caller is verified, the payout method is the caller's and its rail is configured, the
amount is available (escrow and pending holds are not), and the caller's withdrawals in the last
24 hours stay within the market's per-account limit. Deposits are limited per account per 24 hours,
and a tenant's available balance may not exceed the market's balance limit.

Every account has its own counterpart for the outside world (`external:<id>:deposits`,
`external:<id>:withdrawals`), so no party can exhaust a counter that others depend on.
"""

from __future__ import annotations

from sqlalchemy import Connection, func, select
from sqlalchemy.exc import IntegrityError

from runyard.market import ledger
from runyard.market.errors import Conflict, LimitExceeded, NotFound
from runyard.market.models import CreditIn, PayoutMethodIn, RailEventIn, WithdrawIn
from runyard.market.schema import accounts, ledger_accounts, payout_methods, rail_events, transfers
from runyard.market.service import Market, Principal, audit
from runyard.market.states import SYSTEM, Actor

DAY = 86400
IN_REASONS = ("deposit", "operator_credit")


def own_account_code(account_id: int, role: str) -> str:
    return f"tenant:{account_id}:available" if role == "tenant" else f"provider:{account_id}:earnings"


def _moved_today(conn: Connection, account: int, side: str, reasons: tuple[str, ...], now: int) -> int:
    column = transfers.c.credit_account_id if side == "in" else transfers.c.debit_account_id
    total = conn.execute(
        select(func.coalesce(func.sum(transfers.c.amount), 0)).where(
            column == account, transfers.c.reason.in_(reasons), transfers.c.created_at > now - DAY
        )
    ).scalar_one()
    return int(total)


def _credit_tenant(
    conn: Connection, tenant_id: int, amount: int, reason: str, actor: Actor, now: int, daily: bool
) -> int:
    """Move `amount` from the tenant's outside-world account into its available balance, within
    the per-account limits. Returns the transfer id."""
    config = Market.config(conn)
    own = ledger.account_id(conn, own_account_code(tenant_id, "tenant"))
    if daily and _moved_today(conn, own, "in", IN_REASONS, now) + amount > config["deposit_limit_per_day"]:
        raise LimitExceeded(
            f"account {tenant_id} may take in at most {config['deposit_limit_per_day']} per 24 hours",
            limit="deposit_limit_per_day",
        )
    if ledger.balance(conn, own).posted + amount > config["balance_limit"]:
        raise LimitExceeded(
            f"account {tenant_id}'s balance may hold at most {config['balance_limit']}", limit="balance_limit"
        )
    outside = ledger.open_account(
        conn, ledger.external_code(tenant_id, "deposits"), "external_deposits", tenant_id
    )
    return ledger.transfer(conn, outside, own, amount, reason=reason, actor=str(actor), now=now)


def _tenant(conn: Connection, account: str | int) -> dict:
    text = str(account)
    column = accounts.c.id if text.isdigit() else accounts.c.name
    if text.isdigit() and int(text) > 2**63 - 1:
        raise NotFound(f"no account {text}")
    row = (
        conn.execute(select(accounts).where(column == (int(text) if text.isdigit() else text)))
        .mappings()
        .one_or_none()
    )
    if row is None:
        raise NotFound(f"no account {text}")
    if row["role"] != "tenant":
        raise Conflict(f"account {row['name']} is a {row['role']}; only tenants hold deposits")
    return dict(row)


def rail_deposit(market: Market, rail: str, event: RailEventIn) -> dict:
    """Apply a rail's (already verified) deposit event, once per (rail, event id)."""

    def seen(conn: Connection) -> dict | None:
        row = (
            conn.execute(
                select(rail_events).where(rail_events.c.rail == rail, rail_events.c.event_id == event.id)
            )
            .mappings()
            .one_or_none()
        )
        if row is not None and (row["account_id"], row["amount"]) != (event.account_id, event.amount):
            raise Conflict(f"rail event {event.id} was applied before with other values")
        return None if row is None else _event_json(row, duplicate=True)

    def tx(conn: Connection, now: int) -> dict:
        earlier = seen(conn)
        if earlier is not None:
            return earlier
        currency = Market.config(conn)["currency"]
        if event.currency != currency:
            raise Conflict(f"this market holds {currency}; the event is in {event.currency}")
        tenant = _tenant(conn, event.account_id)
        try:
            # The same event delivered twice at once: the second waits on the first's row and then
            # fails on the unique (rail, event id); it answers as a duplicate.
            with conn.begin_nested():
                transfer_id = _credit_tenant(
                    conn, tenant["id"], event.amount, "deposit", SYSTEM, now, daily=True
                )
                conn.execute(
                    rail_events.insert().values(
                        rail=rail, event_id=event.id, account_id=tenant["id"], amount=event.amount,
                        transfer_id=transfer_id, received_at=now,
                    )
                )  # fmt: skip
        except IntegrityError:
            earlier = seen(conn)
            if earlier is None:
                raise
            return earlier
        audit(
            conn,
            SYSTEM,
            "funds.deposit",
            f"account:{tenant['id']}",
            now,
            rail=rail,
            event=event.id,
            amount=event.amount,
        )
        return _event_json({"event_id": event.id, "rail": rail, "account_id": tenant["id"], "amount": event.amount,
                            "transfer_id": transfer_id}, duplicate=False)  # fmt: skip

    return market.write(tx)


def _event_json(row, duplicate: bool) -> dict:  # type: ignore[no-untyped-def]
    return {
        "event_id": row["event_id"], "rail": row["rail"], "account_id": row["account_id"],
        "amount": row["amount"], "transfer_id": row["transfer_id"], "duplicate": duplicate,
    }  # fmt: skip


def credit(market: Market, principal: Principal, body: CreditIn, key: str | None) -> dict:
    """An operator credits a tenant's available balance (a deposit made outside any rail)."""
    principal.require_role("operator")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("credit accounts", conn)  # a revoked operator, now
        tenant = _tenant(conn, body.account)
        transfer_id = _credit_tenant(
            conn, tenant["id"], body.amount, "operator_credit", principal.actor, now, daily=False
        )
        audit(
            conn,
            principal.actor,
            "funds.credit",
            f"account:{tenant['id']}",
            now,
            amount=body.amount,
            reason=body.reason,
        )
        own = ledger.account_id(conn, own_account_code(tenant["id"], "tenant"))
        return {
            "transfer_id": transfer_id,
            "amount": body.amount,
            "balance": ledger.balance(conn, own).to_json(),
        }

    return market.idempotent(principal, key, "funds.credit", body.model_dump(), tx)


def add_payout_method(market: Market, principal: Principal, body: PayoutMethodIn, key: str | None) -> dict:
    """Register where the caller's withdrawals are paid (a destination on a configured rail)."""
    principal.require_role("tenant", "provider")
    if body.rail not in market.rails:
        raise Conflict(f"no payment rail {body.rail!r} here; configured: {sorted(market.rails)}")

    def tx(conn: Connection, now: int) -> dict:
        method_id = conn.execute(
            payout_methods.insert().values(
                account_id=principal.id, rail=body.rail, destination=body.destination, created_at=now
            )
        ).inserted_primary_key[0]
        audit(conn, principal.actor, "funds.payout_method", f"account:{principal.id}", now, rail=body.rail)
        return _method_json(
            conn.execute(select(payout_methods).where(payout_methods.c.id == method_id)).mappings().one()
        )

    return market.idempotent(principal, key, "funds.payout_method", body.model_dump(), tx)


def _method_json(row) -> dict:  # type: ignore[no-untyped-def]
    return {k: row[k] for k in ("id", "rail", "destination", "created_at")}


def list_payout_methods(market: Market, principal: Principal) -> list[dict]:
    def tx(conn: Connection, now: int) -> list[dict]:
        rows = conn.execute(
            select(payout_methods)
            .where(payout_methods.c.account_id == principal.id)
            .order_by(payout_methods.c.id)
        ).mappings()
        return [_method_json(r) for r in rows]

    return market.read(tx)


def withdraw(market: Market, principal: Principal, body: WithdrawIn, key: str | None) -> dict:
    """Pay out of the market (a tenant's available balance or a provider's earnings) to one of the
    caller's payout methods, after the checks in the module docstring."""
    principal.require_role("tenant", "provider")

    def tx(conn: Connection, now: int) -> dict:
        principal.require_verified("withdraw", conn)
        method = (
            conn.execute(
                select(payout_methods).where(
                    payout_methods.c.id == body.payout_method_id, payout_methods.c.account_id == principal.id
                )
            )
            .mappings()
            .one_or_none()
        )
        if method is None:
            raise NotFound(f"no payout method {body.payout_method_id} of yours")
        if method["rail"] not in market.rails:
            raise Conflict(f"payout method {method['id']}'s rail {method['rail']!r} is not configured here")
        own = ledger.account_id(conn, own_account_code(principal.id, principal.role))
        limit = Market.config(conn)["withdrawal_limit_per_day"]
        if _moved_today(conn, own, "out", ("withdrawal",), now) + body.amount > limit:
            raise LimitExceeded(
                f"{principal.name} may withdraw at most {limit} per 24 hours",
                limit="withdrawal_limit_per_day",
            )
        outside = ledger.open_account(
            conn, ledger.external_code(principal.id, "withdrawals"), "external_withdrawals", principal.id
        )
        transfer_id = ledger.transfer(
            conn, own, outside, body.amount, reason="withdrawal", actor=str(principal.actor), now=now
        )
        audit(
            conn, principal.actor, "funds.withdraw", f"account:{principal.id}", now,
            amount=body.amount, payout_method=method["id"], rail=method["rail"], destination=method["destination"],
        )  # fmt: skip
        return {
            "transfer_id": transfer_id,
            "amount": body.amount,
            "balance": ledger.balance(conn, own).to_json(),
        }

    return market.idempotent(principal, key, "funds.withdraw", body.model_dump(), tx)


def balances(market: Market, principal: Principal) -> dict:
    """Every ledger account the caller owns (available or earnings, and each escrow), not the
    outside world's counterparts."""

    def tx(conn: Connection, now: int) -> dict:
        rows = conn.execute(
            select(ledger_accounts)
            .where(ledger_accounts.c.owner_id == principal.id, ledger_accounts.c.kind.not_like("external%"))
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
