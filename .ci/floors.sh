#!/usr/bin/env bash
# Install runyard by role with every runtime dependency at the floor pyproject.toml states
# (`name>=floor` becomes `name==floor`) in fresh virtual environments, and run a fast subset of the tests
# in each. A floor that is false (the code uses something newer) fails here instead of on a user's
# machine, and so does a role that reaches for another role's stack:
#   1. the trainer, `pip install runyard`: no server or database library installed or imported;
#   2. the same venv plus the extras market, control and serve;
#   3. a market host: runyard --no-deps plus the market extra, with no torch at all.
# The dev extra is not installed at its floors: only the test runner, at the versions it names.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv="${FLOORS_VENV:-$(mktemp -d -t runyard-floors-XXXXXX)}"
trap 'rm -rf "$venv"' EXIT

constraints="$venv/floors.txt"
"$python" -m venv "$venv"
# floors.txt: every runtime dependency (the base install and the role extras) pinned at its floor;
# market.txt: the market extra's requirements alone.
"$venv/bin/python" .ci/floor_pins.py pyproject.toml "$constraints" "$venv/market.txt"

check_floors() {  # every pinned distribution installed in venv $1 is at its floor
  "$1/bin/python" .ci/floor_check.py "$constraints"
}

export OMP_NUM_THREADS=1
test_runner=("pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100")

echo "-- the trainer: pip install runyard (no extras), at the floors"
"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, on its own: the CPU wheel this machine keeps (a resolver that reached PyPI for torch
# would fetch a multi-GB CUDA build).
"$venv/bin/python" -m pip install -q -c "$constraints" torch
"$venv/bin/python" -m pip install -q -c "$constraints" -e . "${test_runner[@]}"
check_floors "$venv"
# Model and data (torch, numpy, tokenizers, safetensors, pyarrow, zstandard, fsspec), spec (pydantic,
# yaml), training checkpoints (torch.distributed.checkpoint), evaluation, and the trainer's role test.
RUNYARD_ROLE=trainer "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" -x \
  tests/test_roles.py tests/cli/test_verbs.py tests/model tests/data tests/spec/test_job.py tests/train \
  tests/evaluate

echo "-- the server roles: pip install 'runyard[market,control,serve]', at the floors"
"$venv/bin/python" -m pip install -q -c "$constraints" -e ".[market,control,serve]"
check_floors "$venv"
# The control plane's queue and the market's store, ledger and API (sqlalchemy, alembic, fastapi,
# httpx, cryptography) and the serving engine.
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" -x \
  tests/control/test_scheduler.py tests/control/test_store.py \
  tests/market/test_ledger.py tests/market/test_matching.py tests/market/test_signing.py \
  tests/market/test_store.py tests/market/test_e2e_http.py tests/serve/test_engine.py tests/serve/test_drift.py

echo "-- a market host: runyard --no-deps plus the market extra, at the floors, no torch"
market_venv="$venv/market-host"
"$python" -m venv "$market_venv"
"$market_venv/bin/python" -m pip install -q --upgrade pip
"$market_venv/bin/python" -m pip install -q --no-deps -e .
"$market_venv/bin/python" -m pip install -q -c "$constraints" -r "$venv/market.txt" "${test_runner[@]}"
check_floors "$market_venv"
RUNYARD_ROLE=market "$market_venv/bin/python" -m pytest -q -p no:cacheprovider -x tests/test_roles.py
