"""A standing lease's roll-outs: requested -> switched | failed, or withdrawn.

  requested --provider: the new server answered and the endpoint moved to it--> switched
  requested --provider: the new server failed its check; the old one keeps serving--> failed
  requested --system: the lease ended before the provider took it--> failed
  requested --tenant--> withdrawn

A lease has at most one requested roll-out at a time; each roll-out, once ended, stays as the
lease's history (what was served, when, and why a switch failed).
"""

from __future__ import annotations

from runyard.market.schema import rollouts
from runyard.market.states import Machine, sides

REQUESTED = "requested"
SWITCHED = "switched"
FAILED = "failed"
WITHDRAWN = "withdrawn"

ROLLOUT = Machine(
    entity="rollout",
    table=rollouts,
    initial=REQUESTED,
    table_of_transitions={
        (REQUESTED, SWITCHED): sides("provider"),
        (REQUESTED, FAILED): sides("provider", "system"),
        (REQUESTED, WITHDRAWN): sides("tenant"),
    },
)
