"""Python's cyclic garbage collector, held off while a block allocates many objects that live.

A full collection walks every tracked object; in a process holding a model, an optimizer and torch's
own modules that is a few hundred thousand. Such a collection starts when enough new objects have
survived, so a block that builds many (a checkpoint's plan and metadata) triggers one at a random
moment, and a load or a save's stall on the training loop waits for all of it. Objects that die are
still freed at once by reference counting.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic cyclic collection inside the block (it runs again as before after it)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
