#!/usr/bin/env bash
# `make demo-cluster`: the operator, a scripted agent and the example policy against a throwaway
# kube-apiserver on this machine (see hack/demo_cluster.py and docs/local-mode.md).
# Needs what `make test` needs: the .venv and the control-plane binaries (built once, cached).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  echo "no .venv: run 'make demo-cluster' (it sets one up) or 'make .venv/bin/.installed'" >&2
  exit 2
fi
# exec: Ctrl-C and SIGTERM reach the Python process, which stops everything it started.
exec .venv/bin/python hack/demo_cluster.py "$@"
