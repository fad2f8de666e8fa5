"""The suite's xdist groups hold: under `--dist loadgroup` (scripts/test.sh) a test marked with an xdist group
runs under a node id that names the group, which is how pytest-xdist sends a group to one worker. A pytest and
xdist pair that drops the name (pytest 9.2 with xdist 3.8 did) would spread the Slurm, PostgreSQL, browser and
shared-fixture groups over several workers at once without a word; this says so instead."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.xdist_group("suite_groups")


def test_a_grouped_test_runs_under_its_groups_name(request):
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run by pytest-xdist with --dist loadgroup (scripts/test.sh runs it so)")
    assert request.node.nodeid.endswith("@suite_groups"), (
        f"{request.node.nodeid}: pytest-xdist did not put this test in its group (pytest and pytest-xdist "
        "versions that do not work together: see the pin in pyproject.toml)")
