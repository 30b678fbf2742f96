#!/usr/bin/env bash
# Generate the Python stubs of the kubelet PodResources v1 API from
# gpuwarden/agent/podresources/podresources.proto (a verbatim copy of
# k8s.io/kubelet pkg/apis/podresources/v1/api.proto).
#
# Outputs, committed next to the proto:
#   podresources_pb2.py       messages
#   podresources_pb2.pyi      message type stubs (mypy reads these)
#   podresources_pb2_grpc.py  PodResourcesListerStub / Servicer
#
# The proto is compiled with the repository root as its include path, so the
# generated _grpc module imports `gpuwarden.agent.podresources.podresources_pb2`
# (an absolute import that works wherever the package is installed).
#
# The generated code checks its runtime at import: protobuf of the same major and at
# least the protoc release (printed below), and grpcio >= the grpcio-tools release.
# Regenerating with newer tools raises those floors; keep pyproject's pins in step.
#
# Usage: hack/gen-podresources.sh   (needs grpcio-tools: pip install -e '.[test]')
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-${ROOT}/.venv/bin/python}"
cd "${ROOT}"

"${PYTHON}" -m grpc_tools.protoc \
	--proto_path=. \
	--python_out=. \
	--pyi_out=. \
	--grpc_python_out=. \
	gpuwarden/agent/podresources/podresources.proto

# `make lint` checks the tree with ruff and mypy --strict. pyproject excludes the
# generated *.py files, but not the .pyi that mypy reads in their place, and mypy
# still follows imports into excluded modules. So: bring the stub to the project's
# ruff style, and tell mypy the generated code is not ours to type-check (callers of
# it still are, against the stub's declarations).
OUT=gpuwarden/agent/podresources
RUFF="${RUFF:-${ROOT}/.venv/bin/ruff}"
prepend() { printf '%s\n' "$1" | cat - "$2" >"$2.tmp" && mv "$2.tmp" "$2"; }
# protoc writes bare `Mapping` for message-or-dict arguments.
prepend '# mypy: disable-error-code="type-arg"' "${OUT}/podresources_pb2.pyi"
prepend '# mypy: ignore-errors' "${OUT}/podresources_pb2_grpc.py"
# format, fix (imports, `X | None`), format again: the fixes change line lengths.
"${RUFF}" format --quiet "${OUT}/podresources_pb2.pyi"
"${RUFF}" check --quiet --fix "${OUT}/podresources_pb2.pyi"
"${RUFF}" format --quiet "${OUT}/podresources_pb2.pyi"

echo "generated with $("${PYTHON}" -m grpc_tools.protoc --version) (grpcio-tools $("${PYTHON}" -c 'import grpc_tools, importlib.metadata as m; print(m.version("grpcio-tools"))'))"
