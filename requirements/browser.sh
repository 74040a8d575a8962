#!/usr/bin/env bash
# Installs Debian's Chromium (package chromium -> /usr/bin/chromium) for the HTML report's browser test
# (tests/test_report_browser.py drives it headless through playwright, which is in the test extras and
# never downloads a browser of its own). Idempotent: does nothing when Chromium is already there.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1; then
  SUDO="sudo"
else
  echo "browser.sh: Chromium is not installed and apt needs root; install the 'chromium' package" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q >/dev/null
$SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null
