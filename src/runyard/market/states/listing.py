"""Listings: open -> withdrawn. A withdrawn listing takes no new leases; running ones go on."""

from __future__ import annotations

from runyard.market.schema import listings
from runyard.market.states import Machine, sides

OPEN = "open"
WITHDRAWN = "withdrawn"

LISTING = Machine(
    entity="listing",
    table=listings,
    initial=OPEN,
    table_of_transitions={(OPEN, WITHDRAWN): sides("provider", "operator")},
)
