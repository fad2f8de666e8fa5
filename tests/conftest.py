"""Suite-wide settings: keep torch to one thread per test process so that tests on a 2-core CI machine
do not fight each other, and give the session its own data and environment caches (set before any
fixture, so module-scoped fixtures and the subprocesses they start use them too).

Under pytest-xdist (scripts/test.sh runs `-n auto --dist loadgroup`) the controller sets the caches
before it starts its workers, so every worker shares them: the data cache takes a lock per dataset (one
preparer at a time, the others wait and reuse it, as several ranks or Slurm tasks do), so sharing is safe
and a dataset prepared by one worker is reused by the other; the environment cache's archive memo is
written atomically (an entry lost to a concurrent writer is hashed again). Temporary directories (tmp_path,
tmp_path_factory) are per worker, as xdist makes them.

Tiers (tests/tiers.py): the fast tier is the default; tests marked `full` (the rest of a matrix whose
first instance stays fast) are deselected unless `--all` is given, RUNYARD_TEST_TIER=full is set, a -m
expression names `full`, or the test is named by its id on the command line. The full tier also runs
hypothesis at its full example counts."""

from __future__ import annotations

import importlib.util
import os
import tempfile

import pytest

from tests import tiers

# Test modules that need a library outside the trainer's base install (the dev or predict extras). In the
# role venvs .ci/floors.sh builds (RUNYARD_ROLE set) a module whose library is absent is not collected;
# everywhere else (the dev venv, CI's suite) it runs, and a missing library fails it.
NEEDS_LIBRARY = {
    "test_chat.py": "transformers",
    "test_hf_directories.py": "transformers",
    "test_hf_export.py": "transformers",
    "test_hf_interop.py": "transformers",
    "test_hf_memory.py": "transformers",
    "test_instruct.py": "transformers",
    "test_init_weights.py": "transformers",
    "test_prediction.py": "sklearn",
    "test_tabular_families.py": "lightgbm",
    "test_gguf.py": "gguf",
    "test_minhash_kernel.py": "numba",
}


def pytest_ignore_collect(collection_path, config):
    library = NEEDS_LIBRARY.get(collection_path.name)
    if library and os.environ.get("RUNYARD_ROLE"):
        return importlib.util.find_spec(library) is None
    return None


def pytest_addoption(parser):
    parser.addoption("--all", action="store_true", dest="runyard_all",
                     help="run the full tier too (tests marked `full`; hypothesis at full example counts)")


def pytest_configure(config):
    if config.getoption("runyard_all", False):
        os.environ["RUNYARD_TEST_TIER"] = "full"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:  # the default for a @given test that names no count (tests with their own use tiers.examples)
        from hypothesis import settings

        settings.register_profile("runyard-fast", max_examples=25)
        settings.register_profile("runyard-full", max_examples=100)
        settings.load_profile("runyard-full" if tiers.full_tier() else "runyard-fast")
    except ImportError:
        pass
    if "RUNYARD_CACHE_DIR" not in os.environ:
        os.environ["RUNYARD_CACHE_DIR"] = tempfile.mkdtemp(prefix="runyard-test-cache-")
    if "RUNYARD_ENV_CACHE" not in os.environ:  # environment locks' archive memo, rebuilt venvs
        os.environ["RUNYARD_ENV_CACHE"] = tempfile.mkdtemp(prefix="runyard-test-env-cache-")
    if "RUNYARD_PLAN_CACHE" not in os.environ:  # the plan's machine measurements (fixed costs), never ~/.cache
        os.environ["RUNYARD_PLAN_CACHE"] = tempfile.mkdtemp(prefix="runyard-test-plan-cache-")
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:
        pass


def _named_tests(config) -> list[str]:
    """The test ids named on the command line (`path::test[...]`), as pytest's node ids: they run whatever
    their tier."""
    named = []
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if not sep:
            continue
        try:
            relative = (config.invocation_params.dir / path).resolve().relative_to(config.rootpath)
        except ValueError:
            continue
        named.append(f"{relative.as_posix()}::{rest}")
    return named


def _param_values(item) -> list[str]:
    callspec = getattr(item, "callspec", None)
    return [v for v in callspec.params.values() if isinstance(v, str)] if callspec else []


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    # Tests that share one daemon or database run on one xdist worker (serially, as before xdist), unless
    # their module already keeps them with its own expensive fixtures (one group per test: xdist joins
    # several names into a new group).
    postgres_cases: set[tuple[str, str]] = set()
    for item in items:
        on_postgres = "postgres" in _param_values(item)  # a `backend` or `market_url` case on PostgreSQL
        if on_postgres:
            # The rest of a matrix on PostgreSQL is the full tier's: its first case proves the property
            # on PostgreSQL, every case runs on SQLite (e.g. 15 bad bodies x 2 backends: 15 + 1 fast).
            function = (item.path.as_posix(), item.originalname)
            if function in postgres_cases:
                item.add_marker(pytest.mark.full)
            postgres_cases.add(function)
        if item.get_closest_marker("xdist_group"):
            continue
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))  # one Slurm cluster, its queue and nodes
        elif on_postgres:
            item.add_marker(pytest.mark.xdist_group("postgres"))  # one PostgreSQL server
    if tiers.full_tier() or "full" in (config.getoption("markexpr", "") or ""):
        return
    named = _named_tests(config)
    keep, full = [], []
    for item in items:
        left_out = item.get_closest_marker("full") and not any(item.nodeid.startswith(n) for n in named)
        (full if left_out else keep).append(item)
    if full:
        config.hook.pytest_deselected(items=full)
        items[:] = keep
