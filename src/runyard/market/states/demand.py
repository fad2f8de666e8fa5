"""Demands: open -> matched | cancelled | expired, and matched -> open | cancelled.

An open demand holds its escrow as a pending transfer. Matching posts it (at the listing's price)
and binds a lease; cancelling (tenant) or expiry (no match before the latest start) voids it.
When its lease ends before it starts (rejected, expired, cancelled by an operator) the lease's
escrow returns and the demand is open again with a fresh hold, never offered the same listing
twice; when the tenant cancels the lease, or the hold cannot be made again, it is cancelled.
"""

from __future__ import annotations

from runyard.market.schema import demands
from runyard.market.states import Machine, sides

OPEN = "open"
MATCHED = "matched"
CANCELLED = "cancelled"
EXPIRED = "expired"

DEMAND = Machine(
    entity="demand",
    table=demands,
    initial=OPEN,
    table_of_transitions={
        (OPEN, MATCHED): sides("system"),
        (OPEN, CANCELLED): sides("tenant", "operator"),
        (OPEN, EXPIRED): sides("system"),
        (MATCHED, OPEN): sides("system"),
        (MATCHED, CANCELLED): sides("tenant", "system"),
    },
)
