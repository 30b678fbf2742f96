#!/usr/bin/env bash
# Publish a release to one OCI registry: both images and the chart (`make release`).
#
#   make release VERSION=0.1.0 REGISTRY=registry.example.com [INSECURE=1]
#
#   REGISTRY/gpuwarden/gpuwarden-agent:VERSION      Dockerfile.agent
#   REGISTRY/gpuwarden/gpuwarden-operator:VERSION   Dockerfile.operator
#   oci://REGISTRY/gpuwarden/charts/gpuwarden       the chart, version and appVersion VERSION
#
# With REGISTRY=ghcr.io that is what the chart's image defaults name (ghcr.io/gpuwarden/...:<appVersion>);
# elsewhere install with --set global.imageRegistry=REGISTRY:
#
#   helm install gpuwarden oci://REGISTRY/gpuwarden/charts/gpuwarden --version VERSION \
#     --namespace gpuwarden-system --set global.imageRegistry=REGISTRY
#
# VERSION must be pyproject.toml's: one version for the package, both images and the chart
# (tests/unit/test_cli_version.py). The images are hack/build-images.sh's (podman, on its local Debian base,
# this machine's architecture), tagged VERSION; .github/workflows/release.yml builds the public
# release's for amd64 and arm64 instead. INSECURE=1: the registry speaks plain HTTP (a test registry).
# Needs root (podman) and helm (HELM, default the pinned one of hack/build-control-plane.sh).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION="${1:-}"
REGISTRY="${2:-}"
INSECURE="${INSECURE:-0}"
die() { echo "release: $*" >&2; exit 1; }

[[ -n "${VERSION}" && -n "${REGISTRY}" ]] || die "usage: make release VERSION=X.Y.Z REGISTRY=HOST[:PORT][/PATH]"
want="$(sed -n 's/^version = "\(.*\)"$/\1/p' "${ROOT}/pyproject.toml" | head -n1)"
[[ "${VERSION}" == "${want}" ]] || die "VERSION ${VERSION} is not pyproject.toml's ${want}: bump that first"
if [[ -z "${HELM:-}" ]]; then
	HELM="$("${ROOT}/hack/build-control-plane.sh" --print-env | sed -n 's/^HELM=//p')"
fi
[[ -x "${HELM}" ]] || die "helm not found at '${HELM}' (set HELM)"

tls=(--tls-verify=true)
plain=()
if [[ "${INSECURE}" == 1 ]]; then
	tls=(--tls-verify=false)
	plain=(--plain-http)
fi

env_lines="$("${ROOT}/hack/build-images.sh" --print-env)"
image_of() { sed -n "s/^$1=//p" <<<"${env_lines}"; }
for component in agent operator; do
	built="$(image_of "${component^^}_IMAGE")"
	[[ -n "${built}" ]] || die "hack/build-images.sh printed no ${component^^}_IMAGE"
	target="${REGISTRY}/gpuwarden/gpuwarden-${component}:${VERSION}"
	podman tag "${built}" "${target}"
	podman push "${tls[@]}" "${target}" >&2
	echo "pushed ${target}"
done

dist="${ROOT}/dist"
mkdir -p "${dist}"
"${HELM}" package "${ROOT}/charts/gpuwarden" --version "${VERSION}" --app-version "${VERSION}" -d "${dist}" >&2
"${HELM}" push "${dist}/gpuwarden-${VERSION}.tgz" "oci://${REGISTRY}/gpuwarden/charts" "${plain[@]}" >&2
echo "pushed oci://${REGISTRY}/gpuwarden/charts/gpuwarden:${VERSION}"
