"""Demands: open -> matched | cancelled | expired.

An open demand holds its escrow as a pending transfer. Matching posts it (at the listing's price)
and binds a lease; cancelling (tenant) or expiry (no match before the latest start) voids it.
"""

from __future__ import annotations

from runyard.market.machines import Machine, sides
from runyard.market.schema import demands

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
    },
)
