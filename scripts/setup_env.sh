#!/usr/bin/env bash
# Defines `setup_env [EXTRAS]`: create or refresh the project's virtual environment (.venv), install
# runyard into it (with the given extras, e.g. `dev`) and put it first on PATH. Sourced by
# scripts/demo.sh and scripts/test.sh. On a machine without an NVIDIA GPU the CPU wheel of torch is
# installed first, so the `torch>=2.13` range in pyproject.toml never pulls a CUDA build.
set -euo pipefail

setup_env() {
local repo_root venv python extras
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${RUNYARD_VENV:-$repo_root/.venv}"
python="${PYTHON:-python3}"
extras="${1:-}"

if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
pip_install() { "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$venv/bin/python" -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install "torch>=2.13"
  else
    # The CPU build, as pip finds it on this machine's wheel mirror. Elsewhere, point pip at a CPU
    # wheel index (PIP_EXTRA_INDEX_URL) to avoid the CUDA build.
    pip_install "torch==2.13.0"
  fi
fi
if [ -n "$extras" ]; then
  pip_install -e "$repo_root[$extras]"
else
  pip_install -e "$repo_root"
fi
# An editable install leaves runyard's byte-code to the first import, which PYTHONDONTWRITEBYTECODE (set
# on some machines) forbids: then every runyard process compiles the sources again (about half a second
# each, and the test suite starts hundreds). Compiling them once here costs a few seconds.
"$venv/bin/python" -m compileall -q "$repo_root/src/runyard" >/dev/null
export PATH="$venv/bin:$PATH"
}
