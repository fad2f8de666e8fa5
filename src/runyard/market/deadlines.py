"""The sweep: every deadline that has passed, applied by the market itself (the system actor).

Leases not accepted or started in time expire, demands past their latest start expire, windows
that have ended close (a standing lease's period that has ended renews it or ends it:
`periods.renew_or_close`), and whatever can be settled is settled (a running standing lease's
finished periods too). Each step runs in its own
transaction and re-checks its condition under the row lock, so a sweep racing a party is harmless.
A step that fails (a lease that cannot settle, say) is logged, reported in the result and skipped:
it never stops the steps after it, and the next sweep tries it again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy import Connection, or_, select

from runyard.market import escrow, periods
from runyard.market.errors import MarketError, NotVerified
from runyard.market.leases import end_before_start
from runyard.market.matcher import release_capacity
from runyard.market.rows import lock_demand, lock_lease
from runyard.market.schema import demands, leases
from runyard.market.service import Market, Principal
from runyard.market.settlement import settle_in_tx
from runyard.market.states import SYSTEM, transition
from runyard.market.states.demand import DEMAND
from runyard.market.states.demand import EXPIRED as DEMAND_EXPIRED
from runyard.market.states.demand import OPEN as DEMAND_OPEN
from runyard.market.states.lease import ACCEPTED, EXPIRED, LEASE, OFFERED, RUNNING, SETTLEABLE, WINDOW_CLOSED


def _due(now: int):  # type: ignore[no-untyped-def]
    def read(conn: Connection, _now: int) -> dict[str, list[int]]:
        def ids(query) -> list[int]:  # type: ignore[no-untyped-def]
            return list(conn.execute(query).scalars().all())

        return {
            "expire": ids(
                select(leases.c.id).where(
                    or_(
                        (leases.c.state == OFFERED) & (leases.c.accept_by < now),
                        (leases.c.state.in_((OFFERED, ACCEPTED))) & (leases.c.start_by < now),
                    )
                )
            ),
            "close": ids(select(leases.c.id).where(leases.c.state == RUNNING, leases.c.window_end <= now)),
            "settle": ids(select(leases.c.id).where(
                leases.c.state.in_(SETTLEABLE) | ((leases.c.form == "standing") & (leases.c.state == RUNNING))
            )),
            "demands": ids(
                select(demands.c.id).where(demands.c.state == DEMAND_OPEN, demands.c.latest_start < now)
            ),
        }

    return read


def _expire_lease(conn: Connection, lease_id: int, now: int) -> int:
    lease = lock_lease(conn, lease_id, None)
    if lease["state"] == OFFERED and lease["accept_by"] < now:
        reason = "accept_timeout"
    elif lease["state"] in (OFFERED, ACCEPTED) and lease["start_by"] < now:
        reason = "start_timeout"
    else:
        return 0
    end_before_start(conn, lease, EXPIRED, SYSTEM, reason, now)
    return 1


def _close_window(conn: Connection, lease_id: int, now: int) -> int:
    lease = lock_lease(conn, lease_id, None)
    if lease["state"] != RUNNING or lease["window_end"] > now:
        return 0
    if lease["form"] == "standing":
        periods.renew_or_close(conn, lease, now)
        return int(lease["state"] != RUNNING)
    transition(conn, LEASE, lease_id, WINDOW_CLOSED, SYSTEM, "window ended", now)
    release_capacity(conn, lease, now)
    return 1


def _expire_demand(conn: Connection, demand_id: int, now: int) -> int:
    row = lock_demand(conn, demand_id)
    if (
        row is None
        or row["state"] != DEMAND_OPEN
        or row["latest_start"] is None
        or row["latest_start"] >= now
    ):
        return 0
    transition(conn, DEMAND, demand_id, DEMAND_EXPIRED, SYSTEM, "no match before latest_start", now)
    escrow.release(conn, row["escrow_pending_id"], SYSTEM, now)
    return 1


log = logging.getLogger("runyard.market.deadlines")


def sweep(market: Market, principal: Principal | None = None) -> dict:
    """Apply every deadline that has passed; returns how many of each were applied, and the
    leases whose step failed (`failed`: lease or demand id, error code, message). `principal`: the
    operator asking over the API (None: the market's own sweeper), whose verification is read again
    inside every transaction, so a revocation that commits mid-sweep stops it there."""
    now = market.now()

    def verified(conn: Connection, lock: bool = True) -> None:
        if principal is not None:
            principal.require_verified("sweep", conn, lock=lock)

    todo = market.read(lambda conn, n: (verified(conn, lock=False), _due(now)(conn, n))[1])
    failed: list[dict] = []

    def each(ids: list[int], step: Callable[[Connection, int, int], object], what: str) -> list[object]:
        results = []
        for entity_id in ids:
            try:
                results.append(market.store.write(lambda c, i=entity_id: (verified(c), step(c, i, now))[1]))
            except NotVerified:
                raise  # the operator was revoked: nothing more is applied in its name
            except Exception as exc:  # one bad lease must not stop the others; reported below
                code = exc.code if isinstance(exc, MarketError) else type(exc).__name__
                log.error(
                    "sweep: %s %s failed: %s", what, entity_id, exc, exc_info=not isinstance(exc, MarketError)
                )
                failed.append({"lease_id": entity_id, "error": code, "message": f"{what}: {exc}"[:500]})
        return results

    done: dict = {
        "expired": sum(each(todo["expire"], _expire_lease, "expire lease")),  # type: ignore[arg-type]
        "closed": sum(each(todo["close"], _close_window, "close window")),  # type: ignore[arg-type]
        "demands_expired": sum(each(todo["demands"], _expire_demand, "expire demand")),  # type: ignore[arg-type]
    }
    to_settle = sorted(set(todo["settle"]) | set(todo["close"]))
    settled = each(to_settle, lambda c, i, n: settle_in_tx(c, i, SYSTEM, n), "settle lease")
    done["settled"] = sum(1 for s in settled if s["state"] == "settled")  # type: ignore[index]
    done["failed"] = failed
    return done
