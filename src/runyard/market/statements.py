"""Statements: what happened to an account's money, line by line, with totals that reconcile.

A tenant's statement satisfies, to the minor unit:
    deposited - withdrawn - charged + held_refunded == available (posted) + held in escrow (posted)
where `deposited` counts rail deposits and operator credits.
where `charged` is everything its leases paid to providers and in fees (a standing lease's credits
return to the tenant, so they are never charged: `credited` shows them), and `held_refunded` what
an operator refunded of a revoked provider's held earnings (revocation.py). A provider's satisfies:
    earned - withdrawn == earnings balance, with earned + held + held_refunded + fees == charged to
its tenants, where `held` is what its held accounts hold now (`earned` includes what was released).
The market fee rate applies per lease (fixed when the lease is made) and shows on every line.
"""

from __future__ import annotations

from sqlalchemy import Connection, func, or_, select

from runyard.market import ledger
from runyard.market.errors import BadRequest
from runyard.market.schema import leases, ledger_accounts, transfers
from runyard.market.service import Market, Principal


def _sum(conn: Connection, *where) -> int:  # type: ignore[no-untyped-def]
    # int(): PostgreSQL sums BIGINT into NUMERIC, which arrives as a Decimal.
    return int(
        conn.execute(select(func.coalesce(func.sum(transfers.c.amount), 0)).where(*where)).scalar_one()
    )


def _lease_lines(conn: Connection, column) -> list[dict]:  # type: ignore[no-untyped-def]
    rows = conn.execute(select(leases).where(column).order_by(leases.c.id)).mappings()
    return [
        {
            "lease_id": r["id"],
            "state": r["state"],
            "devices": r["devices"],
            "price_per_device_hour": r["price_per_device_hour"],
            "escrow_amount": r["escrow_amount"],
            "fee_bps": r["fee_bps"],
            "charged": r["paid_provider"] + r["paid_fee"],
            "paid_provider": r["paid_provider"],
            "fee": r["paid_fee"],
            "refunded": r["refunded"],
            "credited": r["credited"],
            "form": r["form"],
        }
        for r in rows
    ]


def _entries(conn: Connection, ids: list[int]) -> list[dict]:
    rows = conn.execute(
        select(transfers)
        .where(or_(transfers.c.debit_account_id.in_(ids), transfers.c.credit_account_id.in_(ids)))
        .order_by(transfers.c.id)
    ).mappings()
    codes = dict(conn.execute(select(ledger_accounts.c.id, ledger_accounts.c.code)).all())
    return [
        {
            "transfer_id": r["id"],
            "at": r["created_at"],
            "kind": r["kind"],
            "reason": r["reason"],
            "from": codes[r["debit_account_id"]],
            "to": codes[r["credit_account_id"]],
            "amount": r["amount"],
            "lease_id": r["lease_id"],
            "demand_id": r["demand_id"],
        }
        for r in rows
    ]


def statement(market: Market, principal: Principal) -> dict:
    """The caller's statement: balances, every ledger entry, per-lease lines and totals."""

    def tx(conn: Connection, now: int) -> dict:
        config = Market.config(conn)
        owned = (
            conn.execute(
                select(ledger_accounts).where(
                    ledger_accounts.c.owner_id == principal.id, ledger_accounts.c.kind.not_like("external%")
                )
            )
            .mappings()
            .all()
        )
        ids = [a["id"] for a in owned]
        balances = {
            a["code"]: ledger.Balance(
                a["code"], a["debits_pending"], a["debits_posted"], a["credits_pending"], a["credits_posted"]
            ).to_json()
            for a in owned
        }
        out = {
            "account": {"id": principal.id, "name": principal.name, "role": principal.role},
            "currency": config["currency"],
            "market_fee_bps": config["fee_bps"],
            "balances": balances,
            "entries": _entries(conn, ids),
        }
        if principal.role == "tenant":
            available = ledger.account_id(conn, f"tenant:{principal.id}:available")
            lines = _lease_lines(conn, leases.c.tenant_id == principal.id)
            escrow_posted = sum(b["posted"] for code, b in balances.items() if code.startswith("escrow:"))
            totals = {
                "deposited": _sum(
                    conn,
                    transfers.c.credit_account_id == available,
                    transfers.c.reason.in_(("deposit", "operator_credit")),
                ),
                "withdrawn": _sum(
                    conn, transfers.c.debit_account_id == available, transfers.c.reason == "withdrawal"
                ),
                "charged": sum(line["charged"] for line in lines),
                "fees_in_charges": sum(line["fee"] for line in lines),
                "refunded": sum(line["refunded"] for line in lines),
                "credited": sum(line["credited"] for line in lines),
                "available": balances[f"tenant:{principal.id}:available"]["available"],
                "reserved_for_demands": balances[f"tenant:{principal.id}:available"]["pending_out"],
                "in_escrow": escrow_posted,
                "held_refunded": _sum(
                    conn, transfers.c.credit_account_id == available, transfers.c.reason == "held_refund"
                ),
            }
            totals["reconciles"] = (
                totals["deposited"] - totals["withdrawn"] - totals["charged"] + totals["held_refunded"]
                == balances[f"tenant:{principal.id}:available"]["posted"] + escrow_posted
            )
        elif principal.role == "provider":
            earnings = ledger.account_id(conn, f"provider:{principal.id}:earnings")
            lines = _lease_lines(conn, leases.c.provider_id == principal.id)
            totals = {
                "charged_to_tenants": sum(line["charged"] for line in lines),
                "fees": sum(line["fee"] for line in lines),
                "earned": _sum(
                    conn, transfers.c.credit_account_id == earnings,
                    transfers.c.reason.in_(("settle_provider", "held_release")),
                ),
                "held": sum(b["posted"] for code, b in balances.items() if code.startswith("held:")),
                "held_refunded": _sum(conn, transfers.c.lease_id.in_(select(leases.c.id).where(
                    leases.c.provider_id == principal.id)), transfers.c.reason == "held_refund"),
                "withdrawn": _sum(
                    conn, transfers.c.debit_account_id == earnings, transfers.c.reason == "withdrawal"
                ),
                "earnings_balance": balances[f"provider:{principal.id}:earnings"]["posted"],
            }
            totals["reconciles"] = (
                totals["earned"] - totals["withdrawn"] == totals["earnings_balance"]
                and totals["earned"] + totals["held"] + totals["held_refunded"] + totals["fees"]
                == totals["charged_to_tenants"]
            )
        elif principal.role == "operator":
            lines = _lease_lines(conn, leases.c.id.isnot(None))
            fees = ledger.balance(conn, ledger.account_id(conn, ledger.MARKET_FEES))
            totals = {"fees_collected": fees.posted, "charged": sum(line["charged"] for line in lines)}
            totals["reconciles"] = fees.posted == sum(line["fee"] for line in lines)
        else:
            raise BadRequest(f"no statement for role {principal.role}")
        out["leases"] = lines
        out["totals"] = totals
        return out

    return market.read(tx)
