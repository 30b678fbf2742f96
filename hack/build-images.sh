#!/usr/bin/env bash
# Build the container images the tests and the test node run, with podman and no registry, into a
# cache outside the work tree:
#
#   ${GPUWARDEN_IMAGES_CACHE:-$HOME/.cache/gpuwarden/images}/<name>-<key>.oci.tar
#
# - base: a minimal Debian bookworm with python3 and its venv module (debootstrap from Debian's
#   packages, `podman import`); stands in for python:3.12-slim, which no registry here serves, and is
#   the workload image of test pods (it has `sleep`);
# - agent, operator: Dockerfile.agent and Dockerfile.operator built on that base (--build-arg BASE=...);
# - pause: the test node's sandbox image, hack/images/pause.c compiled statically, nothing else.
#
# <key> is a hash of each image's inputs (its recipe in this script, its Dockerfile, the build context
# .dockerignore lets through, the base's key), so unchanged sources are never rebuilt; the base, slow to
# debootstrap, only changes when its recipe does. Each archive is `podman save --format oci-archive`
# (for `ctr images import`, `podman load`, `skopeo copy`), and each image is also left in podman's
# local storage under the name printed. Archives unused for 3 days are deleted.
#
# The host is set up as needed, idempotently: podman, debootstrap and a static C toolchain from
# Debian's packages; containers.conf default ulimits when the hard limits are below podman's defaults
# (crun: "setrlimit RLIMIT_NOFILE: Operation not permitted"); cgroup v2 controllers moved to v1
# mounts when the machine mixes both (crun: "cgroups in hybrid mode not supported"). Needs root.
#
# Usage:
#   hack/build-images.sh              build what is missing, print KEY=value lines
#   hack/build-images.sh --print-env  same; stdout carries only the KEY=value lines
#   hack/build-images.sh --rebuild    rebuild every image, the base included
#
# Environment:
#   GPUWARDEN_IMAGES_CACHE  cache root (default $HOME/.cache/gpuwarden/images)
#   GPUWARDEN_DEBIAN_MIRROR mirror debootstrap fetches from (default http://deb.debian.org/debian)
#   PIP_CERT, PIP_INDEX_URL, PIP_EXTRA_INDEX_URL
#                           passed to pip inside the builds (a pip.conf mounted at /etc/pip.conf while
#                           they run, never stored in an image): a proxy's CA bundle, a mirror
#
# Output (stdout), the images as name and archive, and the chart's image values for them:
#   IMAGE_REGISTRY=localhost                      global.imageRegistry
#   AGENT_IMAGE=localhost/gpuwarden/gpuwarden-agent:<version>-<key>
#   AGENT_IMAGE_TAG=<version>-<key>               agent.image.tag
#   AGENT_ARCHIVE=<cache>/agent-<key>.oci.tar
#   OPERATOR_IMAGE=..., OPERATOR_IMAGE_TAG=..., OPERATOR_ARCHIVE=...
#   PAUSE_IMAGE=localhost/gpuwarden/pause:<key>, PAUSE_ARCHIVE=...
#   WORKLOAD_IMAGE=..., WORKLOAD_ARCHIVE=...     (the base: a test pod's image, runs `sleep`)
#   BASE_IMAGE=..., BASE_ARCHIVE=...
# Build progress and timings go to stderr.
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

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE="${GPUWARDEN_IMAGES_CACHE:-${HOME}/.cache/gpuwarden/images}"
MIRROR="${GPUWARDEN_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
REGISTRY=localhost
SUITE=bookworm
# python3-venv: `python3 -m venv` with pip (ensurepip), which both Dockerfiles use.
BASE_PACKAGES=python3,python3-venv

log() { echo "build-images: $*" >&2; }
die() { log "error: $*"; exit 1; }

[[ "$(id -u)" == 0 ]] || die "needs root (rootful podman, debootstrap, cgroup mounts); run it with sudo"

mkdir -p "${CACHE}"
# Serialize concurrent builds (parallel CI jobs / pytest sessions on one machine).
exec 9>"${CACHE}/.build.lock"
flock 9

TMP_DIRS=()
cleanup() { [[ ${#TMP_DIRS[@]} -eq 0 ]] || rm -rf "${TMP_DIRS[@]}"; }
trap cleanup EXIT
# new_tmp: a fresh directory in TMP, removed on exit (not `$(...)`: the list must grow in this shell).
new_tmp() {
	TMP="$(mktemp -d "${CACHE}/.tmp.XXXXXX")"
	TMP_DIRS+=("${TMP}")
}

# ------------------------------------------------------------------------------------- host set-up

apt_install() {
	export DEBIAN_FRONTEND=noninteractive
	local opts=(-y -q --no-install-recommends -o DPkg::Lock::Timeout=600)
	log "apt-get install $*"
	apt-get install "${opts[@]}" "$@" >&2 || { apt-get update -q >&2 && apt-get install "${opts[@]}" "$@" >&2; } \
		|| die "apt-get install $* failed"
}

ensure_packages() {
	local missing=()
	command -v podman >/dev/null 2>&1 || missing+=(podman)
	command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
	command -v gcc >/dev/null 2>&1 || missing+=(gcc)
	compgen -G '/usr/lib/*/libc.a' >/dev/null || missing+=(libc6-dev) # gcc -static links it
	[[ ${#missing[@]} -eq 0 ]] || apt_install "${missing[@]}"
}

# crun sets every rlimit of the OCI spec podman writes (nofile 1048576, nproc 4194304 for root) and
# cannot raise one above the hard limit podman runs with; the defaults come from containers.conf. podman
# itself runs with nproc at most kernel.pid_max (seen: 32768 below a hard limit of 96362).
ensure_ulimits() {
	local conf=/etc/containers/containers.conf.d/50-gpuwarden-ulimits.conf nofile nproc pid_max want
	nofile="$(ulimit -Hn)"
	nproc="$(ulimit -Hu)"
	pid_max="$(cat /proc/sys/kernel/pid_max)"
	[[ "${nofile}" == unlimited ]] && nofile=1048576
	[[ "${nproc}" == unlimited || "${nproc}" -gt "${pid_max}" ]] && nproc="${pid_max}"
	if [[ "${nofile}" -ge 1048576 && "${nproc}" -ge 4194304 ]]; then
		rm -f "${conf}"
		return 0
	fi
	want="$(printf '# Written by gpuwarden hack/build-images.sh: this machine'"'"'s hard limits.\n[containers]\ndefault_ulimits = ["nofile=%s:%s", "nproc=%s:%s"]\n' \
		"${nofile}" "${nofile}" "${nproc}" "${nproc}")"
	[[ -f "${conf}" && "$(cat "${conf}")" == "${want}" ]] && return 0
	log "setting podman's default ulimits to this machine's hard limits in ${conf}"
	mkdir -p "$(dirname "${conf}")"
	printf '%s\n' "${want}" >"${conf}"
}

# crun refuses a "hybrid" machine whose cgroup2 hierarchy holds controllers while v1 hierarchies are
# mounted; mounting each of those controllers as its own v1 hierarchy takes it out of cgroup2.
ensure_cgroups() {
	local unified=/sys/fs/cgroup/unified controller controllers=()
	[[ "$(stat -fc %T /sys/fs/cgroup)" == tmpfs && -r "${unified}/cgroup.controllers" ]] || return 0
	read -ra controllers <"${unified}/cgroup.controllers" || true # one line, space-separated; may be empty
	for controller in "${controllers[@]}"; do
		mountpoint -q "/sys/fs/cgroup/${controller}" && continue
		log "mounting the ${controller} cgroup controller as v1 (crun refuses hybrid cgroups)"
		mkdir -p "/sys/fs/cgroup/${controller}"
		mount -t cgroup -o "${controller}" cgroup "/sys/fs/cgroup/${controller}" \
			|| die "mount -t cgroup -o ${controller} failed"
	done
}

# pip inside the builds gets the host's CA bundle (e.g. an intercepting proxy's) and index settings.
write_pip_conf() {
	local dir="$1" ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
	{
		echo "[global]"
		[[ -r "${ca}" ]] && echo "cert = /run/gpuwarden-build/ca.crt"
		[[ -n "${PIP_INDEX_URL:-}" ]] && echo "index-url = ${PIP_INDEX_URL}"
		[[ -n "${PIP_EXTRA_INDEX_URL:-}" ]] && echo "extra-index-url = ${PIP_EXTRA_INDEX_URL}"
		true
	} >"${dir}/pip.conf"
	BUILD_MOUNTS=(--volume "${dir}/pip.conf:/etc/pip.conf:ro")
	[[ -r "${ca}" ]] && BUILD_MOUNTS+=(--volume "$(readlink -f "${ca}"):/run/gpuwarden-build/ca.crt:ro")
	true
}

# ------------------------------------------------------------------------------------------- keys

sha() { sha256sum | cut -c1-12; }

# The build context as .dockerignore lets it through (its `!` lines), without caches.
context_key() {
	local include includes=()
	while read -r include; do
		if [[ -e "${ROOT}/${include}" ]]; then includes+=("${include}"); fi
	done < <(sed -n 's|^!\(.*\)|\1|p' "${ROOT}/.dockerignore" | sed 's|/$||')
	(
		cd "${ROOT}"
		cat .dockerignore
		find "${includes[@]}" -type f ! -path '*/__pycache__/*' ! -name '*.py[cod]' \
			! -path '*/.mypy_cache/*' ! -path '*/.ruff_cache/*' -print0 \
			| sort -z | xargs -0 sha256sum
	) | sha
}

# ------------------------------------------------------------------------------------------ images

# The archive of image $1 is fresh, and the image is in podman's storage (loaded back if it was not).
have_image() {
	local name="$1" archive="$2"
	[[ ${rebuild} -eq 0 && -s "${archive}" ]] || return 1
	touch "${archive}"
	if ! podman image exists "${name}"; then
		log "loading ${name} from ${archive}"
		podman load -q -i "${archive}" >&2 || return 1
		podman image exists "${name}" || return 1
	fi
	return 0
}

# save <name> <archive>: write the OCI archive next to its final path, then rename it into place.
save() {
	local name="$1" archive="$2"
	rm -f "${archive}.partial"
	podman save -q --format oci-archive -o "${archive}.partial" "${name}" >&2
	mv -f "${archive}.partial" "${archive}"
	log "saved ${name}: ${archive} ($(du -h --apparent-size "${archive}" | cut -f1))"
}

build_base() {
	local name="$1" dir start
	new_tmp
	dir="${TMP}"
	start=${SECONDS}
	log "[base] debootstrap --variant=minbase ${SUITE} (+${BASE_PACKAGES}) from ${MIRROR}"
	if ! debootstrap --variant=minbase --include="${BASE_PACKAGES}" "${SUITE}" "${dir}/rootfs" "${MIRROR}" \
		>"${dir}/debootstrap.out" 2>&1; then
		tail -n 40 "${dir}/debootstrap.out" "${dir}/rootfs/debootstrap/debootstrap.log" >&2 || true
		die "[base] debootstrap failed"
	fi
	# What an image needs no copy of: package lists and caches, docs, man pages, translations, logs,
	# and the build machine's own resolv.conf and hostname (the runtime provides them).
	chroot "${dir}/rootfs" apt-get clean
	rm -rf "${dir}/rootfs"/var/lib/apt/lists/* "${dir}/rootfs"/var/cache/apt/* \
		"${dir}/rootfs"/usr/share/doc/* "${dir}/rootfs"/usr/share/man/* "${dir}/rootfs"/usr/share/info/* \
		"${dir}/rootfs"/usr/share/locale/* "${dir}/rootfs"/var/log/* "${dir}/rootfs"/debootstrap \
		"${dir}/rootfs"/etc/resolv.conf "${dir}/rootfs"/etc/hostname
	find "${dir}/rootfs" -depth -name __pycache__ -type d -exec rm -rf {} +
	tar -C "${dir}/rootfs" --numeric-owner --xattrs --exclude='./dev/*' --exclude='./proc/*' \
		--exclude='./sys/*' -cf "${dir}/rootfs.tar" .
	podman import -q \
		--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
		--change 'ENV LANG=C.UTF-8' \
		--change 'CMD ["/bin/bash"]' \
		"${dir}/rootfs.tar" "${name}" >&2
	log "[base] built ${name} in $((SECONDS - start))s"
}

build_pause() {
	local name="$1" dir start
	new_tmp
	dir="${TMP}"
	start=${SECONDS}
	mkdir -p "${dir}/rootfs"
	gcc -static -Os -s -Wall -Wextra -Werror -o "${dir}/rootfs/pause" "${ROOT}/hack/images/pause.c"
	tar -C "${dir}/rootfs" --numeric-owner --owner=0 --group=0 -cf "${dir}/rootfs.tar" pause
	podman import -q --change 'ENTRYPOINT ["/pause"]' "${dir}/rootfs.tar" "${name}" >&2
	log "[pause] built ${name} in $((SECONDS - start))s"
}

# build_app <component> <name> <base name>: Dockerfile.<component> on the local base.
build_app() {
	local component="$1" name="$2" base="$3" start
	start=${SECONDS}
	log "[${component}] podman build -f Dockerfile.${component} --build-arg BASE=${base}"
	# --network host: pip reaches the index the way the host does; nothing else runs in the build.
	# --layers=false: podman 4.3 reusing a cached builder stage leaves `RUN --mount=from=builder` an empty
	# directory (containers/podman#16281), and its cache key ignores what that mount holds (a stale
	# install layer); the key above is the cache. It also commits each stage as one layer.
	podman build --pull=never --layers=false --network host "${BUILD_MOUNTS[@]}" \
		--build-arg "BASE=${base}" --build-arg "VERSION=${VERSION}" \
		-f "${ROOT}/Dockerfile.${component}" -t "${name}" "${ROOT}" >&2 \
		|| die "[${component}] podman build failed"
	log "[${component}] built ${name} in $((SECONDS - start))s"
}

# prune <name> <image name> <archive kept>: the archives of other inputs that nobody used for 3 days,
# and their images in podman's storage (named <repository>:<...key>).
prune() {
	local name="$1" repository="${2%:*}" keep="$3" archive key ref
	while IFS= read -r archive; do
		key="${archive##*/"${name}"-}"
		key="${key%.oci.tar}"
		log "pruning ${archive}, unused for 3 days"
		rm -f "${archive}"
		for ref in $(podman images --noheading --format '{{.Repository}}:{{.Tag}}' --filter "reference=${repository}"); do
			if [[ "${ref}" == *"${key}" ]]; then podman rmi "${ref}" >/dev/null || true; fi
		done
	done < <(find "${CACHE}" -maxdepth 1 -name "${name}-*.oci.tar" ! -path "${keep}" -mtime +3)
}

ensure_packages
ensure_ulimits
ensure_cgroups

VERSION="$(sed -n 's/^version = "\(.*\)"$/\1/p' "${ROOT}/pyproject.toml" | head -n1)"
[[ -n "${VERSION}" ]] || die "no version in pyproject.toml"

BASE_KEY="$({ echo "${SUITE} ${BASE_PACKAGES} $(dpkg --print-architecture)"; declare -f build_base; } | sha)"
BASE_IMAGE="${REGISTRY}/gpuwarden/base:${BASE_KEY}"
BASE_ARCHIVE="${CACHE}/base-${BASE_KEY}.oci.tar"

PAUSE_KEY="$({ cat "${ROOT}/hack/images/pause.c"; declare -f build_pause; gcc --version | head -n1; } | sha)"
PAUSE_IMAGE="${REGISTRY}/gpuwarden/pause:${PAUSE_KEY}"
PAUSE_ARCHIVE="${CACHE}/pause-${PAUSE_KEY}.oci.tar"

CONTEXT_KEY="$(context_key)"
declare -A APP_IMAGE APP_TAG APP_ARCHIVE
for component in agent operator; do
	key="$({
		echo "${BASE_KEY} ${CONTEXT_KEY} ${VERSION}"
		cat "${ROOT}/Dockerfile.${component}"
		declare -f build_app
	} | sha)"
	APP_TAG[${component}]="${VERSION}-${key}"
	APP_IMAGE[${component}]="${REGISTRY}/gpuwarden/gpuwarden-${component}:${VERSION}-${key}"
	APP_ARCHIVE[${component}]="${CACHE}/${component}-${key}.oci.tar"
done

if ! have_image "${BASE_IMAGE}" "${BASE_ARCHIVE}"; then
	build_base "${BASE_IMAGE}"
	save "${BASE_IMAGE}" "${BASE_ARCHIVE}"
fi

if ! have_image "${PAUSE_IMAGE}" "${PAUSE_ARCHIVE}"; then
	build_pause "${PAUSE_IMAGE}"
	save "${PAUSE_IMAGE}" "${PAUSE_ARCHIVE}"
fi

for component in agent operator; do
	if ! have_image "${APP_IMAGE[${component}]}" "${APP_ARCHIVE[${component}]}"; then
		if [[ ! -v BUILD_MOUNTS ]]; then
			new_tmp
			write_pip_conf "${TMP}"
		fi
		build_app "${component}" "${APP_IMAGE[${component}]}" "${BASE_IMAGE}"
		save "${APP_IMAGE[${component}]}" "${APP_ARCHIVE[${component}]}"
	fi
done

# Images built on an old base go before it.
for component in agent operator; do
	prune "${component}" "${APP_IMAGE[${component}]}" "${APP_ARCHIVE[${component}]}"
done
prune pause "${PAUSE_IMAGE}" "${PAUSE_ARCHIVE}"
prune base "${BASE_IMAGE}" "${BASE_ARCHIVE}"

cat <<OUT
IMAGE_REGISTRY=${REGISTRY}
AGENT_IMAGE=${APP_IMAGE[agent]}
AGENT_IMAGE_TAG=${APP_TAG[agent]}
AGENT_ARCHIVE=${APP_ARCHIVE[agent]}
OPERATOR_IMAGE=${APP_IMAGE[operator]}
OPERATOR_IMAGE_TAG=${APP_TAG[operator]}
OPERATOR_ARCHIVE=${APP_ARCHIVE[operator]}
PAUSE_IMAGE=${PAUSE_IMAGE}
PAUSE_ARCHIVE=${PAUSE_ARCHIVE}
WORKLOAD_IMAGE=${BASE_IMAGE}
WORKLOAD_ARCHIVE=${BASE_ARCHIVE}
BASE_IMAGE=${BASE_IMAGE}
BASE_ARCHIVE=${BASE_ARCHIVE}
OUT
