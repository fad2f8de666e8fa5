"""Disputes: open -> upheld | partial | rejected | withdrawn.

The operator resolves an open dispute: `upheld` gives the side that opened it its claim, `rejected`
gives the other side its position, `partial` sets a value between the two. The opener may withdraw.
Until resolved, the disputed amount stays in escrow.
"""

from __future__ import annotations

from runyard.market.schema import disputes
from runyard.market.states import Machine, sides

OPEN = "open"
UPHELD = "upheld"
PARTIAL = "partial"
REJECTED = "rejected"
WITHDRAWN = "withdrawn"

OUTCOMES = (UPHELD, PARTIAL, REJECTED)

DISPUTE = Machine(
    entity="dispute",
    table=disputes,
    initial=OPEN,
    table_of_transitions={
        (OPEN, UPHELD): sides("operator"),
        (OPEN, PARTIAL): sides("operator"),
        (OPEN, REJECTED): sides("operator"),
        (OPEN, WITHDRAWN): sides("tenant", "provider"),
    },
)
