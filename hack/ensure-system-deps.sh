#!/usr/bin/env bash
# Installs the system tools the test suite checks our output with, when they are missing.
# promtool comes from Debian's `prometheus` package; we only need the binary, so no
# recommends and the service is never started.
set -euo pipefail
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    echo "promtool is missing: install Debian's 'prometheus' package (apt-get install prometheus)" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q --no-install-recommends prometheus >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends prometheus >/dev/null; }
  # the package's postinst may start a server we do not want
  pkill -x prometheus 2>/dev/null || true
fi
command -v promtool
