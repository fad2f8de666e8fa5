"""collector_paused: no automatic cyclic collection inside the block, the collector's state restored after."""

from __future__ import annotations

import gc

import pytest

from runyard.system.collector import collector_paused


def test_the_collector_is_off_inside_and_as_it_was_after():
    assert gc.isenabled()
    collections = []
    gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
    try:
        with collector_paused():
            assert not gc.isenabled()
            junk = [[object()] for _ in range(200_000)]  # enough survivors to start collections if enabled
            assert collections == []
            del junk
        assert gc.isenabled()
        with pytest.raises(RuntimeError), collector_paused():
            raise RuntimeError("the block failed")
        assert gc.isenabled(), "re-enabled on the way out of a failing block"
        gc.disable()
        with collector_paused():
            pass
        assert not gc.isenabled(), "a collector someone else had turned off stays off"
    finally:
        gc.enable()
        gc.callbacks.pop()
