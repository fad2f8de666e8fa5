"""Suite-wide settings: keep torch to one thread per test process so that tests on a 2-core CI machine
do not fight each other, and give every test its own data cache."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("RUNYARD_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "runyard-cache"))


def pytest_configure(config):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass
