#!/usr/bin/env bash
# Installs Debian's Chromium (package chromium -> /usr/bin/chromium) for the HTML report's browser test
# (tests/test_report_browser.py drives it headless through playwright, which is in the test extras and
# never downloads a browser of its own). Idempotent: does nothing when Chromium is already there.
#
# Where it cannot (no apt, no root or sudo, apt fails) it says so in one line and exits 0: the rest of
# the set-up and every other test still run, and the browser test skips saying Chromium is not on PATH
# (a skip tests/skip_gate.py allows). Put any Chromium on PATH as `chromium` to run it.
set -euo pipefail
skip() {
  echo "browser.sh: $1; the HTML report's browser test will be skipped (put a Chromium on PATH as 'chromium' to run it)" >&2
  exit 0
}
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || skip "Chromium is not installed and this machine has no apt-get"
if [ "$(id -u)" -eq 0 ]; then
  SUDO=""
elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
else
  skip "Chromium is not installed and apt needs root (no root, no password-less sudo)"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q || skip "apt-get update failed (its output is above)"
$SUDO apt-get install -y -q --no-install-recommends chromium || skip "apt-get install chromium failed (its output is above)"
command -v chromium >/dev/null 2>&1 || skip "the chromium package installed no 'chromium' command"
