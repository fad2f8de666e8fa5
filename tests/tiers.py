"""The suite's two tiers. The fast tier (the default of `scripts/test.sh`) keeps at least one instance
of every property the suite proves; the full tier (`scripts/test.sh --all`, which CI runs) adds the
rest of each matrix (`@pytest.mark.full`) and runs hypothesis at its full example counts."""

from __future__ import annotations

import os


def full_tier() -> bool:
    """True when the full tier runs (`--all`, or RUNYARD_TEST_TIER=full in the environment)."""
    return os.environ.get("RUNYARD_TEST_TIER") == "full"


def examples(full: int, fast: int) -> int:
    """A hypothesis example count: `full` in the full tier, `fast` otherwise."""
    return full if full_tier() else fast
