"""Billing periods of a standing lease: running -> closed -> settled.

  running --its end passes, or the lease ends inside it--> closed --settlement--> settled

A period is created running when the lease starts (period 1) or renews (the next one). It closes
when its end passes (the sweep renews or ends the lease then) or when the lease is terminated
inside it (`ended_at`). It settles once its reports are closed and nothing in it is held: the
provider is paid for the time available, the tenant credited under the listing's rule, and the rest
of the period's escrow returned. The market alone moves periods.
"""

from __future__ import annotations

from runyard.market.schema import lease_periods
from runyard.market.states import Machine, sides

RUNNING = "running"
CLOSED = "closed"
SETTLED = "settled"

PERIOD = Machine(
    entity="period",
    table=lease_periods,
    initial=RUNNING,
    table_of_transitions={
        (RUNNING, CLOSED): sides("system"),
        (CLOSED, SETTLED): sides("system"),
    },
)
