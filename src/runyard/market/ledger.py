"""A double-entry ledger in integer minor units.

Every movement is a transfer that debits one ledger account and credits another by the same amount,
so the sum of all balances is always zero. Transfers are immutable rows. Reservations are two-phase:
a `pending` transfer holds the amount on both accounts, and exactly one later `post` (of at most the
pending amount; the rest is released) or `void` resolves it. The database enforces "exactly one":
post and void rows carry the pending transfer's id in a unique column.

Balances are kept on each account (TigerBeetle's four counters) and re-derived from the transfers by
the audit. An account flagged `no_negative` refuses any transfer after which its debits (posted plus
pending) would exceed its posted credits.
"""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import Connection, select, update

from runyard.market.errors import BadRequest, InsufficientFunds, InvalidTransition
from runyard.market.models import MAX_AMOUNT
from runyard.market.schema import ledger_accounts, transfers

# The ceiling on any counter: far inside a signed 64-bit integer.
MAX_BALANCE = 2**62

# Ledger account kinds and whether each must stay non-negative.
KINDS = {
    "tenant_available": True,
    "escrow": True,
    "provider_earnings": True,
    "held_earnings": True,  # a revoked provider's share of one lease, until the operator decides
    "market_fees": True,
    "external_deposits": False,  # the outside world: goes negative as money comes in
    "external_withdrawals": True,
}
MARKET_FEES = "market:fees"


def external_code(account_id: int, direction: str) -> str:
    """The outside world's side of one account's money in ("deposits") or out ("withdrawals"). One
    per account, so no party can fill a counter that others need."""
    return f"external:{account_id}:{direction}"


@dataclass(frozen=True)
class Balance:
    """An account's counters and what they mean."""

    code: str
    debits_pending: int
    debits_posted: int
    credits_pending: int
    credits_posted: int

    @property
    def posted(self) -> int:
        """Credit-normal posted balance."""
        return self.credits_posted - self.debits_posted

    @property
    def available(self) -> int:
        """What can still be debited: posted balance less outgoing reservations."""
        return self.credits_posted - self.debits_posted - self.debits_pending

    def to_json(self) -> dict:
        return {
            "code": self.code,
            "posted": self.posted,
            "available": self.available,
            "pending_out": self.debits_pending,
            "pending_in": self.credits_pending,
        }


def check_amount(amount: int, what: str = "amount") -> int:
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise BadRequest(f"{what} must be an integer number of minor units, got {amount!r}")
    if amount <= 0:
        raise BadRequest(f"{what} must be positive, got {amount}")
    if amount > MAX_AMOUNT:
        raise BadRequest(f"{what} {amount} exceeds the per-transfer maximum {MAX_AMOUNT}")
    return amount


def open_account(conn: Connection, code: str, kind: str, owner_id: int | None = None) -> int:
    """Create a ledger account (or return the id of the existing one with this code)."""
    existing = conn.execute(select(ledger_accounts.c.id).where(ledger_accounts.c.code == code)).scalar()
    if existing is not None:
        return existing
    return conn.execute(
        ledger_accounts.insert().values(
            code=code,
            kind=kind,
            owner_id=owner_id,
            no_negative=KINDS[kind],
            debits_pending=0,
            debits_posted=0,
            credits_pending=0,
            credits_posted=0,
        )
    ).inserted_primary_key[0]


def account_id(conn: Connection, code: str) -> int:
    found = conn.execute(select(ledger_accounts.c.id).where(ledger_accounts.c.code == code)).scalar()
    if found is None:
        raise KeyError(f"no ledger account {code!r}")
    return found


def balance(conn: Connection, ledger_id: int) -> Balance:
    row = conn.execute(select(ledger_accounts).where(ledger_accounts.c.id == ledger_id)).one()
    return Balance(row.code, row.debits_pending, row.debits_posted, row.credits_pending, row.credits_posted)


def _lock(conn: Connection, ids: list[int]) -> dict[int, dict]:
    """Lock the accounts in id order (so two transfers never wait on each other in a cycle)."""
    rows = conn.execute(
        select(ledger_accounts)
        .where(ledger_accounts.c.id.in_(ids))
        .order_by(ledger_accounts.c.id)
        .with_for_update()
    ).mappings()
    return {row["id"]: dict(row) for row in rows}


def _apply(conn: Connection, accounts: dict[int, dict], changes: dict[int, dict[str, int]]) -> None:
    for acc_id, deltas in changes.items():
        acc = accounts[acc_id]
        new = {k: acc[k] + d for k, d in deltas.items()}
        merged = {**acc, **new}
        if any(v > MAX_BALANCE or v < 0 for v in new.values()):
            raise BadRequest(f"ledger account {acc['code']} would overflow")
        if (
            acc["no_negative"]
            and merged["debits_posted"] + merged["debits_pending"] > merged["credits_posted"]
        ):
            short = merged["debits_posted"] + merged["debits_pending"] - merged["credits_posted"]
            raise InsufficientFunds(
                f"{acc['code']} has {acc['credits_posted'] - acc['debits_posted'] - acc['debits_pending']} "
                f"available; this needs {short} more",
                account=acc["code"],
            )
        conn.execute(update(ledger_accounts).where(ledger_accounts.c.id == acc_id).values(**new))
        acc.update(new)


def _insert(conn: Connection, **values: object) -> int:
    return conn.execute(transfers.insert().values(**values)).inserted_primary_key[0]


def transfer(
    conn: Connection,
    debit: int,
    credit: int,
    amount: int,
    *,
    reason: str,
    actor: str,
    now: int,
    pending: bool = False,
    lease_id: int | None = None,
    demand_id: int | None = None,
) -> int:
    """Move `amount` from `debit` to `credit` (or reserve it, when `pending`). Returns the transfer id."""
    check_amount(amount)
    if debit == credit:
        raise BadRequest("a transfer needs two different accounts")
    accounts = _lock(conn, sorted({debit, credit}))
    side = "pending" if pending else "posted"
    _apply(conn, accounts, {debit: {f"debits_{side}": amount}, credit: {f"credits_{side}": amount}})
    return _insert(
        conn,
        kind="pending" if pending else "single",
        debit_account_id=debit,
        credit_account_id=credit,
        amount=amount,
        reason=reason,
        actor=actor,
        created_at=now,
        lease_id=lease_id,
        demand_id=demand_id,
    )


def _lock_open_pending(conn: Connection, pending_id: int) -> tuple[dict[int, dict], dict]:
    """Lock a pending transfer's two accounts, then check it is still unresolved.

    Returns the locked accounts and the pending transfer. The lock comes before the check for a
    post or void of it, so two resolutions of one hold serialise here and the second one fails.
    """
    pend = conn.execute(select(transfers).where(transfers.c.id == pending_id)).mappings().one_or_none()
    if pend is None or pend["kind"] != "pending":
        raise InvalidTransition(f"transfer {pending_id} is not a pending transfer")
    accounts = _lock(conn, sorted({pend["debit_account_id"], pend["credit_account_id"]}))
    done = conn.execute(select(transfers.c.kind).where(transfers.c.pending_id == pending_id)).scalar()
    if done is not None:
        raise InvalidTransition(f"pending transfer {pending_id} was already {done}ed")
    return accounts, dict(pend)


def post_pending(
    conn: Connection,
    pending_id: int,
    amount: int,
    *,
    reason: str,
    actor: str,
    now: int,
    lease_id: int | None = None,
) -> int:
    """Post a pending transfer for `amount` <= its reserved amount; the rest of the hold is released."""
    accounts, pend = _lock_open_pending(conn, pending_id)
    check_amount(amount)
    if amount > pend["amount"]:
        raise BadRequest(f"cannot post {amount}: pending transfer {pending_id} holds only {pend['amount']}")
    d, c, held = pend["debit_account_id"], pend["credit_account_id"], pend["amount"]
    _apply(
        conn,
        accounts,
        {
            d: {"debits_pending": -held, "debits_posted": amount},
            c: {"credits_pending": -held, "credits_posted": amount},
        },
    )
    return _insert(
        conn,
        kind="post",
        debit_account_id=d,
        credit_account_id=c,
        amount=amount,
        pending_id=pending_id,
        reason=reason,
        actor=actor,
        created_at=now,
        lease_id=lease_id,
        demand_id=pend["demand_id"],
    )


def void_pending(conn: Connection, pending_id: int, *, reason: str, actor: str, now: int) -> int:
    """Release a pending transfer entirely."""
    accounts, pend = _lock_open_pending(conn, pending_id)
    d, c, held = pend["debit_account_id"], pend["credit_account_id"], pend["amount"]
    _apply(conn, accounts, {d: {"debits_pending": -held}, c: {"credits_pending": -held}})
    return _insert(
        conn,
        kind="void",
        debit_account_id=d,
        credit_account_id=c,
        amount=held,
        pending_id=pending_id,
        reason=reason,
        actor=actor,
        created_at=now,
        demand_id=pend["demand_id"],
    )
