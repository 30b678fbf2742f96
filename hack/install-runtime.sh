#!/usr/bin/env bash
# Install the gpuwarden wheel found in WHEEL_DIR, with its runtime dependencies, into the Python
# environment of $PYTHON (default: python3 on PATH), then check that it works. The one install procedure
# for both images (Dockerfile.agent, Dockerfile.operator); tests/unit/test_chart_files.py runs it
# against a fresh virtual environment, so what the images do is tested without a Docker engine.
#
# Usage: hack/install-runtime.sh WHEEL_DIR
# Environment:
#   PYTHON  interpreter whose environment receives the install (default: python3)
#   PIP_*   any pip setting (e.g. PIP_INDEX_URL for a mirror)
set -euo pipefail

die() { echo "install-runtime: error: $*" >&2; exit 1; }

[[ $# -eq 1 ]] || { echo "usage: $0 WHEEL_DIR" >&2; exit 2; }
wheel_dir="$1"
[[ -d "${wheel_dir}" ]] || die "${wheel_dir} is not a directory"
PYTHON="${PYTHON:-python3}"
command -v "${PYTHON}" >/dev/null 2>&1 || die "no Python interpreter '${PYTHON}'"

shopt -s nullglob
wheels=("${wheel_dir}"/gpuwarden-*.whl)
[[ ${#wheels[@]} -eq 1 ]] || die "expected exactly one gpuwarden-*.whl in ${wheel_dir}, found ${#wheels[@]}"

export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

# The wheel plus its dependencies from the index; bytecode is compiled now (pip's default) because the
# containers run with a read-only root filesystem and PYTHONDONTWRITEBYTECODE.
"${PYTHON}" -m pip install --no-input "${wheels[0]}"

# Every installed distribution's requirements are satisfied.
"${PYTHON}" -m pip check

# The entry point runs, and both commands' modules import (the agent's NVML binding loads without a GPU;
# libnvidia-ml is only opened when sampling starts).
bin_dir="$("${PYTHON}" -c 'import sys, sysconfig; print(sysconfig.get_path("scripts"))')"
"${bin_dir}/gpuwarden" version
"${PYTHON}" -c 'import gpuwarden.agent.command, gpuwarden.operator.command, pynvml, kopf'
echo "install-runtime: installed $(basename "${wheels[0]}") into $("${PYTHON}" -c 'import sys; print(sys.prefix)')" >&2
