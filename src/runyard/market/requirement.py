"""The compute requirement: what a run needs, stated so that a market or a scheduler can act on it.

It is the one schema shared by the job spec (`resources.requirement`) and the market (a demand's
requirement). It imports no torch.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator

# Known accelerator kinds. A kind not in this table is rejected so that a typo never silently fails
# to match any listing.
ACCELERATOR_KINDS = (
    "cpu",
    "t4",
    "l4",
    "l40s",
    "a10g",
    "a100-40gb",
    "a100-80gb",
    "h100-80gb",
    "h200-141gb",
    "b200-192gb",
    "mi300x",
)


class Interconnect(StrEnum):
    """Node interconnects, ordered from weakest to strongest (see `rank`)."""

    ETHERNET = "ethernet"
    INFINIBAND = "infiniband"
    NVLINK = "nvlink"

    @property
    def rank(self) -> int:
        return list(Interconnect).index(self)


class StartClass(StrEnum):
    IMMEDIATE = "immediate"  # capacity that starts now
    QUEUED = "queued"  # cheaper capacity that may wait up to a stated queue time


class Requirement(BaseModel):
    """What a run needs from the hardware, and where and when it may run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    accelerator_kinds: list[str] = Field(
        default_factory=lambda: ["cpu"], min_length=1, description="acceptable accelerator kinds"
    )
    device_count: int = Field(default=1, ge=1, le=100_000, description="devices in total")
    min_interconnect: Interconnect = Field(
        default=Interconnect.ETHERNET, description="weakest acceptable link between devices: ethernet < infiniband < nvlink"
    )
    min_interconnect_gbps: int = Field(default=0, ge=0, description="slowest acceptable interconnect, Gbit/s")
    duration_s: int = Field(default=3600, gt=0, le=366 * 86400, description="how long the devices are needed")
    allowed_regions: list[str] | None = Field(
        default=None, description="regions where the data may sit; None means anywhere"
    )
    latest_start: datetime | None = Field(default=None, description="the run must start by then; None means any time")
    start_classes: list[StartClass] = Field(
        default_factory=lambda: [StartClass.IMMEDIATE, StartClass.QUEUED],
        description="acceptable capacity: immediate (starts now) and/or queued (cheaper, may wait)",
    )

    @model_validator(mode="after")
    def _known_kinds(self) -> Requirement:
        unknown = [k for k in self.accelerator_kinds if k not in ACCELERATOR_KINDS]
        if unknown:
            raise ValueError(
                f"unknown accelerator kind(s) {unknown}; expected one of {list(ACCELERATOR_KINDS)}"
            )
        if not self.start_classes:
            raise ValueError("start_classes must name at least one start class")
        return self
