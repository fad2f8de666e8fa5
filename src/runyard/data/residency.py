"""Data residency: the spec may list the regions data may sit in (`data.residency: [eu, uk]`). Every
store and cache carries a region label; writing or copying data into one outside the allowed regions
is refused before any byte moves. A location without a label is refused too when residency is set:
an unknown region cannot be shown to be allowed."""

from __future__ import annotations

import os

from runyard.errors import ResidencyError
from runyard.spec.data import DataSpec


def cache_region(spec: DataSpec) -> str | None:
    """The local cache's region: data.cache_region, else $RUNYARD_REGION."""
    return spec.cache_region or os.environ.get("RUNYARD_REGION") or None


def check_region(allowed: list[str] | None, kind: str, location: str, region: str | None) -> None:
    """Raise ResidencyError unless `region` is one of `allowed` (no-op when allowed is None)."""
    if allowed is None:
        return
    allowed_norm = {a.strip().lower() for a in allowed}
    if region is None:
        raise ResidencyError(
            f"data.residency allows only {sorted(allowed_norm)}, but the {kind} {location} has no region label "
            "(set data.cache_region / RUNYARD_REGION for the cache, data.store.region for the store)"
        )
    if region.strip().lower() not in allowed_norm:
        raise ResidencyError(
            f"data.residency allows only {sorted(allowed_norm)}; refusing to put data in the {kind} "
            f"{location}, which is in region {region!r}"
        )


def check_cache(spec: DataSpec, root: os.PathLike | str) -> None:
    check_region(spec.residency, "cache", str(root), cache_region(spec))


def check_store(spec: DataSpec, url: str, region: str | None) -> None:
    check_region(spec.residency, "store", url, region)
