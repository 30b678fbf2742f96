#!/usr/bin/env bash
# Install the gpuwarden wheel found in WHEEL_DIR, with the runtime dependencies of one component (the
# package's extra of that name), into the Python environment of $PYTHON (default: python3 on PATH),
# check that it works, then remove the installers (pip, setuptools), which nothing runs at runtime. The
# one install procedure for both images (Dockerfile.agent, Dockerfile.operator);
# tests/unit/charts/test_chart_files.py runs it against fresh virtual environments, so what the images do is
# tested without a container engine.
#
# Usage: hack/install-runtime.sh WHEEL_DIR agent|operator
# Environment:
#   PYTHON  interpreter whose environment receives the install (default: python3)
#   PIP_*   any pip setting (e.g. PIP_INDEX_URL for a mirror)
set -euo pipefail

die() { echo "install-runtime: error: $*" >&2; exit 1; }

[[ $# -eq 2 ]] || { echo "usage: $0 WHEEL_DIR agent|operator" >&2; exit 2; }
wheel_dir="$1"
component="$2"
[[ -d "${wheel_dir}" ]] || die "${wheel_dir} is not a directory"
# What the component's command imports, and what only the other one needs (which must not be there).
case "${component}" in
agent) imports="gpuwarden.agent.command, gpuwarden.simserver.command, gpuwarden.agent.podresources.podresources_pb2_grpc, pynvml, grpc.aio" absent=kopf ;;
operator) imports="gpuwarden.operator.command, gpuwarden.operator.handlers, kopf" absent=grpc ;;
*) die "unknown component '${component}' (agent or operator)" ;;
esac
PYTHON="${PYTHON:-python3}"
command -v "${PYTHON}" >/dev/null 2>&1 || die "no Python interpreter '${PYTHON}'"

shopt -s nullglob
wheels=("${wheel_dir}"/gpuwarden-*.whl)
[[ ${#wheels[@]} -eq 1 ]] || die "expected exactly one gpuwarden-*.whl in ${wheel_dir}, found ${#wheels[@]}"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# The wheel plus its dependencies from the index; bytecode is compiled now (pip's default) because the
# containers run with a read-only root filesystem and PYTHONDONTWRITEBYTECODE.
"${PYTHON}" -m pip install --no-input "${wheels[0]}[${component}]"

# Every installed distribution's requirements are satisfied.
"${PYTHON}" -m pip check

# The installers go (about 20 MiB; Python 3.12's venv has no setuptools, which pip just notes).
"${PYTHON}" -m pip uninstall --yes --quiet pip setuptools

# The entry point runs, the component's modules import (the agent's NVML binding loads without a GPU;
# libnvidia-ml is only opened when sampling starts), and the other component's framework is not there.
bin_dir="$("${PYTHON}" -c 'import sys, sysconfig; print(sysconfig.get_path("scripts"))')"
"${bin_dir}/gpuwarden" --version
"${PYTHON}" -c "import ${imports}"
"${PYTHON}" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${absent}') is not None)" \
	|| die "${absent} is installed, but the ${component} does not use it"
echo "install-runtime: installed $(basename "${wheels[0]}")[${component}] into $("${PYTHON}" -c 'import sys; print(sys.prefix)')" >&2
