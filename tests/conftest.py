"""Suite-wide settings: keep torch to one thread per test process so that tests on a 2-core CI machine
do not fight each other, and give the session its own data cache (set before any fixture, so
module-scoped fixtures and the subprocesses they start use it too)."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RUNYARD_CACHE_DIR" not in os.environ:
        os.environ["RUNYARD_CACHE_DIR"] = tempfile.mkdtemp(prefix="runyard-test-cache-")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
