#!/usr/bin/env bash
# README command 2: set up .venv with the test extras and run the test suite on every core
# (pytest-xdist, `-n auto --dist loadgroup`), printing the 25 slowest tests at the end.
#   scripts/test.sh           the fast tier (about 10 to 13 minutes on 2 idle cores): every property the suite proves,
#                             at least once
#   scripts/test.sh --all     the full tier too: every kill point and layout, hypothesis at full example
#                             counts, the API fuzzer (what CI runs)
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"`, `scripts/test.sh tests/market` or
# `scripts/test.sh -n 0` (serial).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
setup_env dev
cd "$repo_root"
# pytest keeps its assertion-rewritten test modules in __pycache__ only when bytecode may be written; with
# PYTHONDONTWRITEBYTECODE set (as on some machines) every xdist worker rewrites all ~500 of them at every run.
unset PYTHONDONTWRITEBYTECODE
exec python -m pytest -n "${RUNYARD_TEST_WORKERS:-auto}" --dist loadgroup --durations=25 "$@"
