#!/usr/bin/env bash
# README command 1: set up .venv and run the embedded demo, a small real end-to-end run that trains a
# language model on this interpreter's own standard library sources.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
setup_env
cd "$repo_root"
exec runyard run examples/stdlib-code.yaml "$@"
