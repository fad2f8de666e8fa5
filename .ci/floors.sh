#!/usr/bin/env bash
# Install runyard with every runtime dependency at the floor pyproject.toml states (`name>=floor`
# becomes `name==floor`) in a fresh virtual environment, then run a fast subset of the tests there.
# A floor that is false (the code uses something newer) fails here instead of on a user's machine.
# The dev extra is not installed at its floors: only the test runner, at the versions it names.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python3}"
venv="${FLOORS_VENV:-$(mktemp -d -t runyard-floors-XXXXXX)}"
trap 'rm -rf "$venv"' EXIT

constraints="$venv/floors.txt"
"$python" -m venv "$venv"
"$venv/bin/python" - "$constraints" <<'EOF'
import re
import sys
import tomllib

project = tomllib.load(open("pyproject.toml", "rb"))["project"]
pins = []
for requirement in project["dependencies"]:
    match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([0-9][^,;\s]*).*", requirement)
    if not match:
        sys.exit(f"pyproject.toml: dependency {requirement!r} has no '>=' floor to test")
    pins.append(f"{match.group(1)}=={match.group(3)}")
open(sys.argv[1], "w").write("\n".join(pins) + "\n")
print("floors:", " ".join(pins))
EOF

"$venv/bin/python" -m pip install -q --upgrade pip
# torch first, on its own: the CPU wheel this machine keeps (a resolver that reached PyPI for torch
# would fetch a multi-GB CUDA build).
"$venv/bin/python" -m pip install -q -c "$constraints" torch
"$venv/bin/python" -m pip install -q -c "$constraints" -e . "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100"
"$venv/bin/python" - "$constraints" <<'EOF'
import importlib.metadata
import re
import sys


def release(version: str) -> tuple[int, ...]:
    """2.13.0+cpu -> (2, 13); 3.1 -> (3, 1): the release numbers, trailing zeros dropped."""
    numbers = [int(n) for n in re.match(r"[0-9]+(?:\.[0-9]+)*", version).group(0).split(".")]
    while len(numbers) > 1 and numbers[-1] == 0:
        numbers.pop()
    return tuple(numbers)


wrong = []
for line in open(sys.argv[1]):
    name, floor = line.strip().split("==")
    installed = importlib.metadata.version(name)
    if release(installed) != release(floor):
        wrong.append(f"{name}: installed {installed}, floor {floor}")
if wrong:
    sys.exit("not at the floors: " + "; ".join(wrong))
print("installed at the floors")
EOF

# A fast subset across the layers the runtime dependencies serve: model and data (torch, numpy,
# tokenizers, safetensors, pyarrow, zstandard, fsspec), spec (pydantic, yaml), training checkpoints
# (torch.distributed.checkpoint), the control plane's queue and the market's store, ledger and API
# (sqlalchemy, alembic, fastapi, httpx, cryptography).
export OMP_NUM_THREADS=1
"$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not slow" -x \
  tests/model tests/data tests/test_spec.py tests/train tests/evaluate \
  tests/control/test_scheduler.py tests/control/test_store.py \
  tests/market/test_ledger.py tests/market/test_matching.py tests/market/test_signing.py \
  tests/market/test_store.py tests/market/test_e2e_http.py
