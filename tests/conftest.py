"""Suite-wide settings: keep torch to one thread per test process so that tests on a 2-core CI machine
do not fight each other, and give the session its own data and environment caches (set before any
fixture, so module-scoped fixtures and the subprocesses they start use them too)."""

from __future__ import annotations

import importlib.util
import os
import tempfile

# Test modules that need a library outside the trainer's base install (the dev or predict extras). In the
# role venvs .ci/floors.sh builds (RUNYARD_ROLE set) a module whose library is absent is not collected;
# everywhere else (the dev venv, CI's suite) it runs, and a missing library fails it.
NEEDS_LIBRARY = {
    "test_hf_interop.py": "transformers",
    "test_hf_memory.py": "transformers",
    "test_instruct.py": "transformers",
    "test_init_weights.py": "transformers",
    "test_prediction.py": "sklearn",
    "test_tabular_families.py": "lightgbm",
}


def pytest_ignore_collect(collection_path, config):
    library = NEEDS_LIBRARY.get(collection_path.name)
    if library and os.environ.get("RUNYARD_ROLE"):
        return importlib.util.find_spec(library) is None
    return None


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
