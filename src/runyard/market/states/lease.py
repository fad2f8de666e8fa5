"""Leases: offered -> accepted -> running -> window_closed -> settled, plus the early ends.

  offered --provider signs--> accepted --provider starts--> running --window ends--> window_closed
  offered --provider--> rejected              offered|accepted --timeout--> expired
  offered|accepted --tenant--> cancelled      running --either side or operator--> terminated
  window_closed|terminated --settlement, nothing held--> settled

rejected, expired and cancelled return the whole escrow at once (reason codes: models.EndReason); settled returns what usage did not
use. An expiry counts against the listing's reliability. An operator's revocation of a party cancels
its unstarted leases and terminates a revoked provider's running ones (revocation.py).
"""

from __future__ import annotations

from runyard.market.schema import leases
from runyard.market.states import Machine, sides

OFFERED = "offered"
ACCEPTED = "accepted"
RUNNING = "running"
WINDOW_CLOSED = "window_closed"
SETTLED = "settled"
REJECTED = "rejected"
EXPIRED = "expired"
CANCELLED = "cancelled"
TERMINATED = "terminated"

# States in which the lease holds listing capacity.
ACTIVE = (OFFERED, ACCEPTED, RUNNING)
# States after which no money may remain in the lease's escrow.
CLOSED = (SETTLED, REJECTED, EXPIRED, CANCELLED)
# States from which settlement may pay out.
SETTLEABLE = (WINDOW_CLOSED, TERMINATED)

LEASE = Machine(
    entity="lease",
    table=leases,
    initial=OFFERED,
    table_of_transitions={
        (OFFERED, ACCEPTED): sides("provider"),
        (OFFERED, REJECTED): sides("provider"),
        (OFFERED, EXPIRED): sides("system"),
        (OFFERED, CANCELLED): sides("tenant", "operator"),
        (ACCEPTED, RUNNING): sides("provider"),
        (ACCEPTED, EXPIRED): sides("system"),
        (ACCEPTED, CANCELLED): sides("tenant", "operator"),
        (RUNNING, WINDOW_CLOSED): sides("provider", "system"),
        (RUNNING, TERMINATED): sides("tenant", "provider", "operator"),
        (WINDOW_CLOSED, SETTLED): sides("system"),
        (TERMINATED, SETTLED): sides("system"),
    },
)
