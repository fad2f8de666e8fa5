"""Suite-wide settings: keep torch to one thread per test process so that tests on a 2-core CI machine
do not fight each other, and give the session its own data and environment caches (set before any
fixture, so module-scoped fixtures and the subprocesses they start use them too)."""

from __future__ import annotations

import os
import tempfile


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if "RUNYARD_CACHE_DIR" not in os.environ:
        os.environ["RUNYARD_CACHE_DIR"] = tempfile.mkdtemp(prefix="runyard-test-cache-")
    if "RUNYARD_ENV_CACHE" not in os.environ:  # environment locks' archive memo, rebuilt venvs
        os.environ["RUNYARD_ENV_CACHE"] = tempfile.mkdtemp(prefix="runyard-test-env-cache-")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
