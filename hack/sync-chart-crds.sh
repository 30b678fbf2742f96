#!/usr/bin/env bash
# Copy the CRDs from crds/ (the source of truth) into the chart's crds/ directory, byte for byte.
# Helm installs the chart's crds/ on first install only; tests/unit/charts/test_chart_files.py checks that the
# two directories hold the same files with the same bytes.
#
# Usage: hack/sync-chart-crds.sh [--check]
#   --check  change nothing; exit 1 and name the files that differ
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="${ROOT}/crds"
DST="${ROOT}/charts/gpuwarden/crds"

check=0
case "${1:-}" in
"") ;;
--check) check=1 ;;
*) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

shopt -s nullglob
src_files=("${SRC}"/*.yaml)
[[ ${#src_files[@]} -gt 0 ]] || { echo "sync-chart-crds: no CRDs in ${SRC}" >&2; exit 1; }

if [[ ${check} -eq 1 ]]; then
	if diff -r "${SRC}" "${DST}" >/dev/null 2>&1; then
		exit 0
	fi
	echo "sync-chart-crds: ${DST} differs from ${SRC}; run hack/sync-chart-crds.sh" >&2
	diff -rq "${SRC}" "${DST}" >&2 || true
	exit 1
fi

mkdir -p "${DST}"
# Remove chart CRDs that no longer exist at the top level, then copy each file with mode 0644.
for f in "${DST}"/*.yaml; do
	[[ -e "${SRC}/$(basename "${f}")" ]] || rm -f "${f}"
done
for f in "${src_files[@]}"; do
	install -m 0644 "${f}" "${DST}/$(basename "${f}")"
done
echo "sync-chart-crds: copied ${#src_files[@]} file(s) to ${DST#"${ROOT}"/}" >&2
