"""Identity verification: unverified -> pending -> verified | rejected.

Only a verified account may list, demand or be matched. A rejected account may ask again (back to
pending); an operator may revoke a verification (verified -> rejected), which stops new matches.
"""

from __future__ import annotations

from runyard.market.schema import accounts
from runyard.market.states import Machine, sides

UNVERIFIED = "unverified"
PENDING = "pending"
VERIFIED = "verified"
REJECTED = "rejected"

IDENTITY = Machine(
    entity="identity",
    table=accounts,
    initial=UNVERIFIED,
    table_of_transitions={
        # An operator may open a review itself (and does, for operator accounts).
        (UNVERIFIED, PENDING): sides("tenant", "provider", "operator"),
        (REJECTED, PENDING): sides("tenant", "provider"),
        # The verifier decides; the default verifier is an operator, an automatic one acts as system.
        (PENDING, VERIFIED): sides("operator", "system"),
        (PENDING, REJECTED): sides("operator", "system"),
        (VERIFIED, REJECTED): sides("operator"),
    },
)
