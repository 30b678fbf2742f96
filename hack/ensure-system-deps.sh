#!/usr/bin/env bash
# Installs the system tools the test suite needs, when they are missing, from Debian's packages:
#
#   promtool, prometheus          check our metrics and rules; the server runs the dashboards' queries
#                                 and the alerts in tests/integration/test_dashboards.py (prometheus)
#   containerd, ctr, runc         the test node's container runtime (containerd, runc)
#   /usr/lib/cni/{bridge,...}     the test node's pod network     (containernetworking-plugins)
#   iptables, conntrack           kube-proxy's Service routing    (iptables, conntrack)
#   docker-registry               an OCI registry for the release test, `make release` pushes to it
#                                 (tests/integration/test_release.py; run by the test, never a service)
#   libjemalloc.so.2              the operator image's allocator, preloaded by the memory tests
#                                 (tests/unit/operator/test_memory.py) and bench/soak.py (libjemalloc2)
#
# No recommends, and no service is left running: the harness (tests/integration/node.py) starts its
# own containerd with its own root, state and socket.
set -euo pipefail

packages=()
want() { # want <command or absolute path> <Debian package>
  if [[ "$1" == /* ]]; then [[ -e "$1" ]] || packages+=("$2"); else command -v "$1" >/dev/null 2>&1 || packages+=("$2"); fi
}
want promtool prometheus
want prometheus prometheus
want containerd containerd
want ctr containerd
want runc runc
want /usr/lib/cni/bridge containernetworking-plugins
want /usr/lib/cni/host-local containernetworking-plugins
want /usr/lib/cni/loopback containernetworking-plugins
want iptables iptables
want conntrack conntrack
want docker-registry docker-registry
/sbin/ldconfig -p 2>/dev/null | grep -q 'libjemalloc\.so\.2 ' || packages+=(libjemalloc2)
mapfile -t packages < <(printf '%s\n' "${packages[@]}" | sort -u | sed '/^$/d')

if [[ ${#packages[@]} -gt 0 ]]; then
  if [ "$(id -u)" != 0 ]; then
    echo "missing Debian packages: ${packages[*]} (apt-get install --no-install-recommends ${packages[*]})" >&2
    exit 1
  fi
  export DEBIAN_FRONTEND=noninteractive
  # Another apt on the machine (a parallel job) holds the lock for a while; wait for it.
  apt=(apt-get -o DPkg::Lock::Timeout=600 -y -q --no-install-recommends)
  "${apt[@]}" install "${packages[@]}" >/dev/null 2>&1 \
    || { apt-get -o DPkg::Lock::Timeout=600 update -q >/dev/null && "${apt[@]}" install "${packages[@]}" >/dev/null; }
  # the prometheus package's postinst may start a server we do not want
  pkill -x prometheus 2>/dev/null || true
fi
command -v promtool prometheus containerd ctr runc iptables conntrack docker-registry
