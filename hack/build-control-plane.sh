#!/usr/bin/env bash
# Build the Kubernetes binaries used by the integration tests from their Go modules, into
# a cache keyed by version outside the work tree:
#
#   ${GPUWARDEN_TOOLS_CACHE:-$HOME/.cache/gpuwarden/tools}/<name>-<version>/<binary>
#
# The control plane: kube-apiserver, kubectl, etcd, helm. The test node
# (tests/integration/node.py): kubelet, kube-proxy, kube-scheduler,
# kube-controller-manager (the same k8s.io/kubernetes module and build cache as
# kube-apiserver) and CoreDNS (plugins as the node's Corefile uses them). The reclaim
# tests (tests/integration/kueue.py): Kueue's controller manager, and next to it manifests
# copied from the module cache: Kueue's CRD and webhook kustomizations, and the CRDs of
# RayCluster, JobSet and LeaderWorkerSet at the versions Kueue is built against.
#
# Only what is missing is built; a warm cache makes this a no-op. The versions are
# pinned by the wrapper modules under hack/tools/<name>/ (go.mod + go.sum).
#
# Usage:
#   hack/build-control-plane.sh              build what is missing, print KEY=path lines
#   hack/build-control-plane.sh --print-env  same; stdout carries only the KEY=path lines
#   hack/build-control-plane.sh --rebuild    rebuild everything
#
# Environment:
#   GPUWARDEN_TOOLS_CACHE  cache root (default $HOME/.cache/gpuwarden/tools)
#   GPUWARDEN_BUILD_JOBS   go build -p value (default 2)
#   GPUWARDEN_GOCACHE      Go build cache (default $GPUWARDEN_TOOLS_CACHE/go-build)
#   GPUWARDEN_K8S_GIT_COMMIT  commit injected into the Kubernetes version info
#                          (the module proxy does not serve it; default: unknown)
#
# Output (stdout): KUBE_APISERVER=..., KUBECTL=..., ETCD=..., HELM=..., KUBELET=...,
# KUBE_PROXY=..., KUBE_SCHEDULER=..., KUBE_CONTROLLER_MANAGER=..., COREDNS=..., KUEUE=...,
# KUEUE_MANIFESTS=... (a directory), plus <NAME>_VERSION=... lines. Build progress goes to stderr.
set -euo pipefail

usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed -e '$d' -e 's/^# \{0,1\}//'; }

rebuild=0
for arg in "$@"; do
	case "${arg}" in
	--print-env) ;;
	--rebuild) rebuild=1 ;;
	-h | --help) usage; exit 0 ;;
	*) echo "error: unknown argument: ${arg}" >&2; usage >&2; exit 2 ;;
	esac
done

HACK_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
TOOLS_DIR="${HACK_DIR}/tools"
CACHE="${GPUWARDEN_TOOLS_CACHE:-${HOME}/.cache/gpuwarden/tools}"
JOBS="${GPUWARDEN_BUILD_JOBS:-2}"

log() { echo "build-control-plane: $*" >&2; }
die() { log "error: $*"; exit 1; }

# Version of module $2 as required by wrapper module $1 (its go.mod is the pin).
pinned_version() {
	local v
	v="$(awk -v m="$2" '($1 == m || $1 == "require" && $2 == m) {print ($1 == m ? $2 : $3); exit}' "${TOOLS_DIR}/$1/go.mod")"
	[[ -n "${v}" ]] || die "no requirement on $2 in ${TOOLS_DIR}/$1/go.mod"
	echo "${v}"
}

K8S_VERSION="$(pinned_version kubernetes k8s.io/kubernetes)"
ETCD_VERSION="$(pinned_version etcd go.etcd.io/etcd/server/v3)"
HELM_VERSION="$(pinned_version helm helm.sh/helm/v3)"
COREDNS_VERSION="$(pinned_version coredns github.com/coredns/coredns)"
KUEUE_VERSION="$(pinned_version kueue sigs.k8s.io/kueue)"

KUBE_APISERVER="${CACHE}/kube-apiserver-${K8S_VERSION}/kube-apiserver"
KUBECTL="${CACHE}/kubectl-${K8S_VERSION}/kubectl"
ETCD="${CACHE}/etcd-${ETCD_VERSION}/etcd"
HELM="${CACHE}/helm-${HELM_VERSION}/helm"
KUBELET="${CACHE}/kubelet-${K8S_VERSION}/kubelet"
KUBE_PROXY="${CACHE}/kube-proxy-${K8S_VERSION}/kube-proxy"
KUBE_SCHEDULER="${CACHE}/kube-scheduler-${K8S_VERSION}/kube-scheduler"
KUBE_CONTROLLER_MANAGER="${CACHE}/kube-controller-manager-${K8S_VERSION}/kube-controller-manager"
COREDNS="${CACHE}/coredns-${COREDNS_VERSION}/coredns"
KUEUE="${CACHE}/kueue-${KUEUE_VERSION}/kueue"
KUEUE_MANIFESTS="${CACHE}/kueue-${KUEUE_VERSION}/manifests"

mkdir -p "${CACHE}"

# Hermetic-ish Go settings: the local toolchain, module mode, the committed go.sum
# (-mod=readonly: a wrapper whose go.sum is incomplete fails instead of drifting),
# no cgo, reproducible paths.
export GOTOOLCHAIN=local
export GO111MODULE=on
export GOFLAGS="-mod=readonly -buildvcs=false"
export CGO_ENABLED=0
export GOCACHE="${GPUWARDEN_GOCACHE:-${CACHE}/go-build}"
unset GOOS GOARCH GOWORK || true
export GOWORK=off

# Serialize concurrent builds (parallel CI jobs / pytest sessions on one machine).
exec 9>"${CACHE}/.build.lock"
if command -v flock >/dev/null 2>&1; then
	flock 9
fi

needs_build() {
	local bin
	for bin in "$@"; do
		if [[ ${rebuild} -eq 1 || ! -x "${bin}" ]]; then
			return 0
		fi
	done
	return 1
}

# Name `go build -o dir/` gives the binary of package $1: its last path element, or
# the one before a major-version suffix (go.etcd.io/etcd/server/v3 -> "server").
go_bin_name() {
	local base="${1##*/}"
	if [[ "${base}" =~ ^v[0-9]+$ ]]; then
		base="${1%/*}"
		base="${base##*/}"
	fi
	echo "${base}"
}

TMP_DIRS=()
cleanup() { [[ ${#TMP_DIRS[@]} -eq 0 ]] || rm -rf "${TMP_DIRS[@]}"; }
trap cleanup EXIT

# go_build <wrapper> <ldflags> <bin:pkg>...: builds into a temp dir, then renames each
# binary into place (atomic on one filesystem), so a half-built binary is never seen.
go_build() {
	local wrapper="$1" ldflags="$2"
	shift 2
	local tmp start spec bin pkg pkgs=()
	command -v go >/dev/null 2>&1 || die "the go command is not on PATH (need Go >= 1.26) to build ${wrapper}"
	tmp="$(mktemp -d "${CACHE}/.tmp-build.XXXXXX")"
	TMP_DIRS+=("${tmp}")
	for spec in "$@"; do pkgs+=("${spec#*:}"); done
	start=${SECONDS}
	(
		cd "${TOOLS_DIR}/${wrapper}"
		# Fetch every module first: a module the proxy refuses fails here, by name.
		log "[${wrapper}] go mod download"
		go mod download || die "[${wrapper}] go mod download failed (see the module named above)"
		log "[${wrapper}] go build -p ${JOBS} ${pkgs[*]}"
		go build -p "${JOBS}" -trimpath -ldflags "${ldflags}" -o "${tmp}/" "${pkgs[@]}"
	) || die "[${wrapper}] build failed"
	for spec in "$@"; do
		bin="${spec%%:*}"
		pkg="${spec#*:}"
		mkdir -p "$(dirname "${bin}")"
		mv -f "${tmp}/$(go_bin_name "${pkg}")" "${bin}"
		log "[${wrapper}] built ${bin}"
	done
	rm -rf "${tmp}"
	log "[${wrapper}] done in $((SECONDS - start))s"
}

if needs_build "${ETCD}"; then
	go_build etcd "-s -w" "${ETCD}:go.etcd.io/etcd/server/v3"
fi

if needs_build "${HELM}"; then
	helm_ldflags="-s -w -X helm.sh/helm/v3/internal/version.version=${HELM_VERSION}"
	helm_ldflags+=" -X helm.sh/helm/v3/internal/version.gitTreeState=clean"
	go_build helm "${helm_ldflags}" "${HELM}:helm.sh/helm/v3/cmd/helm"
fi

if needs_build "${COREDNS}"; then
	# The wrapper's own main package (hack/tools/coredns/main.go) links the plugins the
	# node's Corefile uses, as CoreDNS documents for builds outside its repository.
	go_build coredns "-s -w" "${COREDNS}:gpuwarden.dev/hack/tools/coredns"
fi

if needs_build "${KUEUE}"; then
	kueue_ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=${KUEUE_VERSION}"
	go_build kueue "${kueue_ldflags}" "${KUEUE}:sigs.k8s.io/kueue/cmd/kueue"
fi
if [[ ${rebuild} -eq 1 || ! -d "${KUEUE_MANIFESTS}" ]]; then
	# The module cache is read-only and may be cleaned: the manifests are copied next to the
	# binary, from the module versions the wrapper's go.sum pins (those Kueue is built with):
	# Kueue's CRD and webhook kustomizations, and the CRDs of the workloads reclaim suspends.
	manifest_modules=(sigs.k8s.io/kueue github.com/ray-project/kuberay/ray-operator sigs.k8s.io/jobset sigs.k8s.io/lws)
	module_dirs="$(cd "${TOOLS_DIR}/kueue" && go mod download "${manifest_modules[@]}" \
		&& go list -m -f '{{.Dir}}' "${manifest_modules[@]}")" \
		|| die "[kueue] could not download ${manifest_modules[*]}"
	{ read -r kueue_dir; read -r kuberay_dir; read -r jobset_dir; read -r lws_dir; } <<<"${module_dirs}"
	tmp="$(mktemp -d "${CACHE}/.tmp-build.XXXXXX")"
	TMP_DIRS+=("${tmp}")
	mkdir -p "${tmp}/kueue" "${tmp}/crds"
	cp -r "${kueue_dir}/config/components/crd" "${kueue_dir}/config/components/webhook" "${tmp}/kueue/"
	cp "${kuberay_dir}/config/crd/bases/ray.io_rayclusters.yaml" \
		"${jobset_dir}/config/components/crd/bases/jobset.x-k8s.io_jobsets.yaml" \
		"${lws_dir}/config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml" "${tmp}/crds/"
	chmod -R u+w,go+rX "${tmp}"
	rm -rf "${KUEUE_MANIFESTS}"
	mkdir -p "$(dirname "${KUEUE_MANIFESTS}")"
	mv "${tmp}" "${KUEUE_MANIFESTS}"
	log "[kueue] manifests in ${KUEUE_MANIFESTS}"
fi

# Every binary of k8s.io/kubernetes goes through one `go build`, so the packages they
# share are compiled once; only the missing ones are linked.
k8s_specs=()
for spec in \
	"${KUBE_APISERVER}:k8s.io/kubernetes/cmd/kube-apiserver" \
	"${KUBECTL}:k8s.io/kubernetes/cmd/kubectl" \
	"${KUBELET}:k8s.io/kubernetes/cmd/kubelet" \
	"${KUBE_PROXY}:k8s.io/kubernetes/cmd/kube-proxy" \
	"${KUBE_SCHEDULER}:k8s.io/kubernetes/cmd/kube-scheduler" \
	"${KUBE_CONTROLLER_MANAGER}:k8s.io/kubernetes/cmd/kube-controller-manager"; do
	if needs_build "${spec%%:*}"; then
		k8s_specs+=("${spec}")
	fi
done
if [[ ${#k8s_specs[@]} -gt 0 ]]; then
	k8s_info="$(cd "${TOOLS_DIR}/kubernetes" && go mod download -json "k8s.io/kubernetes@${K8S_VERSION}")" \
		|| die "go mod download k8s.io/kubernetes@${K8S_VERSION} failed"
	k8s_info_file="$(sed -n 's/^[[:space:]]*"Info": "\(.*\)",$/\1/p' <<<"${k8s_info}")"
	# buildDate = the release's publication time on the proxy (reproducible).
	build_date="$(sed -n 's/.*"Time": *"\([^"]*\)".*/\1/p' "${k8s_info_file}")"
	[[ -n "${build_date}" ]] || build_date="1970-01-01T00:00:00Z"
	minor="${K8S_VERSION#v1.}"
	minor="${minor%%.*}"
	k8s_ldflags="-s -w"
	for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
		k8s_ldflags+=" -X ${pkg}.gitVersion=${K8S_VERSION}"
		k8s_ldflags+=" -X ${pkg}.gitMajor=1"
		k8s_ldflags+=" -X ${pkg}.gitMinor=${minor}"
		k8s_ldflags+=" -X ${pkg}.gitTreeState=clean"
		k8s_ldflags+=" -X ${pkg}.gitCommit=${GPUWARDEN_K8S_GIT_COMMIT:-unknown}"
		k8s_ldflags+=" -X ${pkg}.buildDate=${build_date}"
	done
	go_build kubernetes "${k8s_ldflags}" "${k8s_specs[@]}"
fi

cat <<OUT
KUBE_APISERVER=${KUBE_APISERVER}
KUBECTL=${KUBECTL}
ETCD=${ETCD}
HELM=${HELM}
KUBELET=${KUBELET}
KUBE_PROXY=${KUBE_PROXY}
KUBE_SCHEDULER=${KUBE_SCHEDULER}
KUBE_CONTROLLER_MANAGER=${KUBE_CONTROLLER_MANAGER}
COREDNS=${COREDNS}
KUEUE=${KUEUE}
KUEUE_MANIFESTS=${KUEUE_MANIFESTS}
KUBERNETES_VERSION=${K8S_VERSION}
ETCD_VERSION=${ETCD_VERSION}
HELM_VERSION=${HELM_VERSION}
COREDNS_VERSION=${COREDNS_VERSION}
KUEUE_VERSION=${KUEUE_VERSION}
OUT
