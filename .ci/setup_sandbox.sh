#!/usr/bin/env bash
# Install bubblewrap, the sandbox the control plane runs lease jobs in (runyard.control.sandbox),
# and check that it can make its namespaces here. Debian 12, as root. Idempotent. Appends
# `export RUNYARD_TEST_BWRAP=1` to .ci/env when the sandbox works.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v bwrap >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
fi
# The namespaces lease jobs get: user (where allowed), pid, net, ipc, uts, cgroup.
bwrap --unshare-all --die-with-parent --new-session --ro-bind / / --proc /proc --dev /dev true
bwrap --version

mkdir -p "$repo_root/.ci"
grep -qx 'export RUNYARD_TEST_BWRAP=1' "$repo_root/.ci/env" 2>/dev/null || echo 'export RUNYARD_TEST_BWRAP=1' >>"$repo_root/.ci/env"
