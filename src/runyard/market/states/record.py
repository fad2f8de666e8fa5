"""Usage records: reported -> acknowledged | part_acknowledged | disputed -> resolved.

A tenant acknowledges a record in full or in part, or disputes it, within the dispute window; the
provider may contest a partial acknowledgement (part_acknowledged -> disputed). A tenant's own
measurement that disagrees beyond tolerance disputes the record by itself (system). A record left
alone past the window counts as accepted in full. A disputed record is resolved when its dispute is
(by the operator) or withdrawn (by its opener); `acked_device_seconds` then holds the outcome.
"""

from __future__ import annotations

from runyard.market.schema import usage_records
from runyard.market.states import Machine, sides

REPORTED = "reported"
ACKNOWLEDGED = "acknowledged"
PART_ACKNOWLEDGED = "part_acknowledged"
DISPUTED = "disputed"
RESOLVED = "resolved"

RECORD = Machine(
    entity="record",
    table=usage_records,
    initial=REPORTED,
    table_of_transitions={
        (REPORTED, ACKNOWLEDGED): sides("tenant"),
        (REPORTED, PART_ACKNOWLEDGED): sides("tenant"),
        (REPORTED, DISPUTED): sides("tenant", "system"),
        (PART_ACKNOWLEDGED, DISPUTED): sides("provider"),
        (DISPUTED, RESOLVED): sides("tenant", "provider", "operator"),
    },
)
