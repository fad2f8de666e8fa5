#!/usr/bin/env bash
# README command 2: set up .venv with the test extras and run the whole test suite (slow tests included).
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` or `scripts/test.sh tests/market`.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
setup_env dev
cd "$repo_root"
exec python -m pytest "$@"
