"""The market's core: a store, a clock, the operator's settings, and the two ways an operation runs:
`write` (one transaction) and `idempotent` (one transaction guarded by the caller's idempotency key).

Operations live in their own modules (identity, funds, orders, leases, usage, settlement,
statements) and take a `Market` plus the `Principal` who asks. The HTTP API and the tests call the
same functions.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, select, update
from sqlalchemy.exc import IntegrityError

from runyard.market import ledger
from runyard.market.errors import BadRequest, Conflict, Forbidden, IdempotencyConflict, NotVerified
from runyard.market.rails import Rail
from runyard.market.schema import accounts, audit_log, idempotency_keys, market_config
from runyard.market.signing import canonical_bytes
from runyard.market.states import Actor
from runyard.market.states.identity import VERIFIED
from runyard.market.store import Store
from runyard.market.verifiers import Verifier


@dataclass(frozen=True)
class Settings:
    """What the operator sets when the market is created (the fee can be changed later)."""

    currency: str = "USD"
    fee_bps: int = 0
    dispute_window_s: int = 86400
    accept_timeout_s: int = 900
    start_timeout_s: int = 3600
    tolerance_bps: int = 500
    test_clock: bool = False
    deposit_limit_per_day: int = 10**12  # per account, rolling 24 hours
    withdrawal_limit_per_day: int = 10**12  # per account, rolling 24 hours
    balance_limit: int = 10**13  # most a tenant's available balance may hold


@dataclass(frozen=True)
class Principal:
    """The authenticated caller."""

    id: int
    name: str
    role: str
    state: str
    public_key: str

    @property
    def actor(self) -> Actor:
        return Actor(self.role, self.id)

    def require_role(self, *roles: str) -> None:
        if self.role not in roles:
            raise Forbidden(f"this needs a {' or '.join(roles)} account; {self.name} is a {self.role}")

    def require_verified(self, what: str, conn: Connection, lock: bool = True) -> None:
        """NotVerified unless the account is verified *now*: its state is read again inside the
        caller's write transaction (under a share lock), never taken from authentication, so a
        revocation that commits first is always seen and one that commits later waits for this."""
        if self.id == 0 and self.role == "operator":
            return  # the operator at the console (cli/market_admin.py): direct access to the store, no account
        query = select(accounts.c.state).where(accounts.c.id == self.id)
        state = conn.execute(query.with_for_update(read=True) if lock else query).scalar_one()
        if state != VERIFIED:
            raise NotVerified(f"{self.name} is {state}; only verified accounts may {what}")


def audit(conn: Connection, actor: Actor | str, action: str, subject: str, now: int, **detail: Any) -> None:
    """Append one row to the audit log."""
    conn.execute(
        audit_log.insert().values(
            at=now,
            actor=str(actor),
            action=action,
            subject=subject,
            detail=json.dumps(detail, sort_keys=True),
        )
    )


def check_idempotency_key(key: str | None) -> str:
    if not key:
        raise BadRequest("this request moves money: send an Idempotency-Key header (any unique string)")
    if len(key) > 200 or not key.isprintable():
        raise BadRequest("Idempotency-Key must be 1-200 printable characters")
    return key


class Market:
    """A market over one store. Create it with `Market.open(url)`."""

    def __init__(
        self,
        store: Store,
        verifier: Verifier,
        rails: Mapping[str, Rail] | None = None,
        clock: Callable[[], float] = time.time,
    ):
        self.store = store
        self.verifier = verifier
        self.rails: dict[str, Rail] = dict(rails or {})
        self.clock = clock  # the real clock; a simulation may pass a fixed one
        self._offset = store.read(lambda c: c.execute(select(market_config.c.clock_offset_s)).scalar_one())

    @classmethod
    def open(
        cls,
        url: str,
        settings: Settings | None = None,
        *,
        verifier: Verifier,
        rails: Mapping[str, Rail] | None = None,
        migrate: bool = True,
        pool_size: int = 10,
        clock: Callable[[], float] = time.time,
    ) -> Market:
        """Open (and, on an empty database, create) the market stored at `url`. `verifier` decides
        verification requests (`runyard.market.verifiers`); `rails` are the payment rails money
        may arrive through, by name (`runyard.market.rails`)."""
        store = Store(url, pool_size=pool_size)
        if migrate:
            store.migrate()
        settings = settings or Settings()

        def init(conn: Connection) -> None:
            if conn.execute(select(market_config.c.id)).scalar() is None:
                conn.execute(
                    market_config.insert().values(
                        id=1,
                        currency=settings.currency,
                        fee_bps=settings.fee_bps,
                        dispute_window_s=settings.dispute_window_s,
                        accept_timeout_s=settings.accept_timeout_s,
                        start_timeout_s=settings.start_timeout_s,
                        tolerance_bps=settings.tolerance_bps,
                        test_clock=settings.test_clock,
                        clock_offset_s=0,
                        deposit_limit_per_day=settings.deposit_limit_per_day,
                        withdrawal_limit_per_day=settings.withdrawal_limit_per_day,
                        balance_limit=settings.balance_limit,
                    )
                )
                ledger.open_account(conn, ledger.MARKET_FEES, "market_fees")

        store.write(init)
        return cls(store, verifier, rails, clock)

    # -- time -------------------------------------------------------------------------------------

    def now(self) -> int:
        """The market's time: Unix seconds, plus the test clock's offset."""
        return int(self.clock()) + self._offset

    def advance_clock(self, seconds: int, actor: Actor, principal: Principal | None = None) -> int:
        """Move a test clock forward (only markets created with test_clock=True). `principal`: the
        operator calling over the API, whose verification is read again inside the transaction."""
        if seconds < 0 or seconds > 10 * 366 * 86400:
            raise BadRequest(f"advance must be between 0 and ten years of seconds, got {seconds}")

        def tx(conn: Connection) -> int:
            if principal is not None:
                principal.require_verified("move the clock", conn)
            if not self.config(conn)["test_clock"]:
                raise Conflict("this market runs on the real clock; its time cannot be moved")
            conn.execute(
                update(market_config).values(clock_offset_s=market_config.c.clock_offset_s + seconds)
            )
            offset = conn.execute(select(market_config.c.clock_offset_s)).scalar_one()
            audit(conn, actor, "clock.advance", "market", self.now(), seconds=seconds)
            return offset

        self._offset = self.store.write(tx)
        return self.now()

    # -- settings ---------------------------------------------------------------------------------

    @staticmethod
    def config(conn: Connection) -> dict:
        return dict(conn.execute(select(market_config)).mappings().one())

    def set_fee(self, fee_bps: int, actor: Actor, principal: Principal | None = None) -> dict:
        """Set the fee for new leases. `principal`: as for `advance_clock`."""
        if not 0 <= fee_bps <= 5000:
            raise BadRequest(f"fee_bps must be between 0 and 5000 (50%), got {fee_bps}")

        def tx(conn: Connection) -> dict:
            if principal is not None:
                principal.require_verified("set the fee", conn)
            conn.execute(update(market_config).values(fee_bps=fee_bps))
            audit(conn, actor, "market.fee", "market", self.now(), fee_bps=fee_bps)
            return self.config(conn)

        return self.store.write(tx)

    # -- running operations -----------------------------------------------------------------------

    def write(self, fn: Callable[[Connection, int], Any]) -> Any:
        """Run `fn(conn, now)` in one write transaction."""
        return self.store.write(lambda conn: fn(conn, self.now()))

    def read(self, fn: Callable[[Connection, int], Any]) -> Any:
        return self.store.read(lambda conn: fn(conn, self.now()))

    def idempotent(
        self,
        principal: Principal,
        key: str | None,
        operation: str,
        params: dict,
        fn: Callable[[Connection, int], dict],
    ) -> dict:
        """Run a money-moving operation once per (caller, key).

        The key row is inserted first, so a concurrent retry of the same key blocks on it and then
        reads the first result instead of doing the work again. A failed operation rolls back with
        its key, so it changed nothing and may be retried.
        """
        key = check_idempotency_key(key)
        params_hash = hashlib.sha256(canonical_bytes({"operation": operation, "params": params})).hexdigest()

        table = idempotency_keys

        def earlier(conn: Connection) -> dict | None:
            found = conn.execute(
                select(table.c.params_hash, table.c.response).where(
                    table.c.account_id == principal.id, table.c.key == key
                )
            ).one_or_none()
            if found is None:
                return None
            if found.params_hash != params_hash:
                raise IdempotencyConflict(
                    f"Idempotency-Key {key!r} was already used for a different request; use a new key",
                    operation=operation,
                )
            return json.loads(found.response)

        def tx(conn: Connection) -> dict:
            first = earlier(conn)
            if first is not None:
                return first
            now = self.now()
            try:
                # A concurrent request with the same key waits here until the first commits, then
                # fails on the unique key: it answers with the first one's result.
                with conn.begin_nested():
                    key_id = conn.execute(
                        table.insert().values(
                            account_id=principal.id,
                            key=key,
                            params_hash=params_hash,
                            response="",
                            created_at=now,
                        )
                    ).inserted_primary_key[0]
            except IntegrityError:
                first = earlier(conn)
                if first is None:
                    raise
                return first
            result = fn(conn, now)
            conn.execute(update(table).where(table.c.id == key_id).values(response=json.dumps(result)))
            return result

        return self.store.write(tx)
