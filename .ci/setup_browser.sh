#!/usr/bin/env bash
# Install headless Chromium and its WebDriver from Debian's packages, for the web consoles' browser tests
# (tests/market/test_console_browser.py, tests/control/test_control_ui.py drive them through Selenium,
# pointed at these binaries: nothing is downloaded at test time). Debian 12, as root. Idempotent.
# Appends to .ci/env: RUNYARD_ARTIFACTS (where the tests save screenshots; CI keeps .ci/artifacts).
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
chromium --version
chromedriver --version
# One page rendered headless, as the tests run it (as root: no sandbox; small /dev/shm in containers).
chromium --headless=new --no-sandbox --disable-dev-shm-usage --disable-gpu --dump-dom 'data:text/html,<p>ok</p>' \
  2>/dev/null | grep -q '<p>ok</p>'

mkdir -p "$repo_root/.ci/artifacts"
line="export RUNYARD_ARTIFACTS=\${RUNYARD_ARTIFACTS:-$repo_root/.ci/artifacts}"
touch "$repo_root/.ci/env"
grep -qxF "$line" "$repo_root/.ci/env" || echo "$line" >>"$repo_root/.ci/env"
