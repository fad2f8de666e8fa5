"""Row locks and ownership checks shared by the operations: a lease or demand is read under
`SELECT ... FOR UPDATE`, and a caller who is not a party to it is told it does not exist."""

from __future__ import annotations

from sqlalchemy import Connection, select

from runyard.market.errors import NotFound
from runyard.market.schema import demands, leases
from runyard.market.service import Principal


def is_party(principal: Principal, row) -> bool:  # type: ignore[no-untyped-def]
    """An operator, or the lease's tenant or provider."""
    return principal.role == "operator" or principal.id in (row["tenant_id"], row["provider_id"])


def lock_lease(conn: Connection, lease_id: int, principal: Principal | None) -> dict:
    """Lock a lease row for this transaction; NotFound unless the caller is a party or an operator
    (no check when `principal` is None: the market itself)."""
    row = (
        conn.execute(select(leases).where(leases.c.id == lease_id).with_for_update()).mappings().one_or_none()
    )
    if row is None or (principal is not None and not is_party(principal, row)):
        raise NotFound(f"no lease {lease_id} of yours")
    return dict(row)


def lock_lease_as(conn: Connection, lease_id: int, principal: Principal, side: str) -> dict:
    """Lock a lease the caller holds as `side` ("tenant" or "provider"); operators may act on any.
    NotFound otherwise, as for a lease that does not exist."""
    lease = lock_lease(conn, lease_id, principal)
    if principal.role != "operator" and lease[f"{side}_id"] != principal.id:
        raise NotFound(f"no lease {lease_id} of yours")
    return lease


def lock_demand(conn: Connection, demand_id: int) -> dict | None:
    row = (
        conn.execute(select(demands).where(demands.c.id == demand_id).with_for_update())
        .mappings()
        .one_or_none()
    )
    return None if row is None else dict(row)
