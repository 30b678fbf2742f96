"""A real Kubernetes node for the integration tests, beside its own control plane.

:class:`Node` starts, on this machine:

* a :class:`controlplane.ControlPlane` of its own, listening on the node's bridge address
  (pods reach it through the ``kubernetes`` Service, whose endpoints the API server keeps),
  with the Node authorizer, NodeRestriction and the ServiceAccount admission plugin;
* containerd (Debian's package) with its own config, root, state and socket, runc, and a
  CNI ``bridge`` + ``host-local`` network; the pause and workload images are imported from
  the OCI archives of ``hack/build-images.sh`` (no registry);
* kube-controller-manager (ReplicaSets, DaemonSets, ServiceAccounts and their tokens, the
  ``kube-root-ca.crt`` ConfigMaps, garbage collection) and kube-scheduler;
* the kubelet, which registers Node ``gpuwarden-node`` (client certificate
  ``system:node:gpuwarden-node``), on this machine's cgroup v1 (``failCgroupV1: false``);
* our device plugin (``deviceplugin.py``), so that the Node has ``nvidia.com/gpu`` devices
  named by the scripted scenario's GPU UUIDs, allocated by the kubelet itself;
* kube-proxy (iptables mode) for Service ClusterIPs, and CoreDNS on the host behind the
  ``kube-system/kube-dns`` Service, the kubelet's ``clusterDNS``.

Each process is a :class:`controlplane.ManagedProcess` (own process group, dies with the
test process). :meth:`Node.stop` deletes every pod through the API (so the kubelet tears
down their sandboxes and CNI networks), stops everything, removes kube-proxy's rules, kills
what containerd left, unmounts what was mounted, and deletes the bridge, the kubelet's
directory, its cgroups and the sysctls it changed.

Some paths cannot move: the kubelet's device-plugin socket directory is compiled in
(``/var/lib/kubelet/device-plugins``), the chart mounts ``/var/lib/kubelet/pod-resources``,
and kube-proxy's iptables chains are per network namespace. So there is one test node per
machine at a time, behind a lock file, and it needs root.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import yaml
from controlplane import (
    Binaries,
    ControlPlane,
    ControlPlaneError,
    ManagedProcess,
    free_ports,
    wait_for,
)
from deviceplugin import RESOURCE_NAME, scenario_uuids
from images import Images

NODE_NAME = "gpuwarden-node"
#: The bridge's address: the pods' gateway, the node's InternalIP, and where the API server,
#: the kubelet and CoreDNS listen (reachable from this machine and its pods only).
NODE_IP = "10.244.0.1"
POD_SUBNET = "10.244.0.0/24"
BRIDGE = "gpuwarden0"
CNI_NETWORK = "gpuwarden-test-node"
CLUSTER_DOMAIN = "cluster.local"
CLUSTER_DNS_IP = "10.0.0.10"
#: The scripted scenario whose GPUs the device plugin advertises: the one the chart's agent plays on
#: this node (test_chart_on_node.py), so that every GPU the kubelet allocates is one the agent reads.
SCENARIO = "e2e-fast"

KUBELET_ROOT = Path("/var/lib/kubelet")
DEVICE_PLUGIN_DIR = KUBELET_ROOT / "device-plugins"
POD_RESOURCES_SOCKET = KUBELET_ROOT / "pod-resources" / "kubelet.sock"
#: Sockets and runtime state of the node's containerd: a fixed place, so that a later start
#: finds (and kills) the shims of a session that died without its teardown.
RUN_DIR = Path("/run/gpuwarden-test-node")
CONTAINERD_SOCKET = RUN_DIR / "containerd.sock"
CONTAINER_LOG_LINKS = Path("/var/log/containers")
CNI_BIN_DIR = Path("/usr/lib/cni")
CNI_CACHE_DIR = Path("/var/lib/cni/results")
NETNS_DIR = Path("/var/run/netns")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: Directories the kubelet and the CNI plugins make outside our own; removed if we made them.
MADE_DIRS = (CONTAINER_LOG_LINKS, CNI_CACHE_DIR, CNI_CACHE_DIR.parent)
LOCK_PATH = Path("/run/lock/gpuwarden-test-node.lock")
#: Written into KUBELET_ROOT: a directory without it is someone else's and is never touched.
MARKER = ".gpuwarden-test-node"

#: Kernel settings the node's components change (the kubelet's kernel tunables, the CNI
#: bridge plugin's forwarding); saved at start and written back at stop.
SYSCTLS = (
    "net/ipv4/ip_forward",
    "net/ipv4/conf/all/route_localnet",
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)

NEEDED_COMMANDS = ("containerd", "ctr", "runc", "iptables", "iptables-restore", "conntrack", "ip", "mount")
NEEDED_CNI_PLUGINS = ("bridge", "host-local", "loopback")

#: How long one node component may take to become ready.
START_TIMEOUT_S = float(os.environ.get("GPUWARDEN_NODE_START_TIMEOUT", "180"))
#: How long start() waits for another session's node on this machine to go away.
LOCK_TIMEOUT_S = float(os.environ.get("GPUWARDEN_NODE_LOCK_TIMEOUT", "1800"))
#: Readiness polls that each cost an API request (node conditions, allocatable).
API_POLL_INTERVAL_S = 0.5


class NodeError(ControlPlaneError):
    """The node (or what it needs on this machine) could not be brought up."""


def _run(argv: list[str], *, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout}")
    return proc


def _http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError):
        return False


def _unverified_tls() -> ssl.SSLContext:
    """For the components' /healthz: they serve self-signed certificates made at start."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _socket_answers(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def missing_prerequisites() -> list[str]:
    """What this machine lacks to run the node (empty when it can)."""
    missing = []
    if os.geteuid() != 0:
        missing.append("root (the kubelet, containerd and CNI need it)")
    missing += [f"the {c} command" for c in NEEDED_COMMANDS if shutil.which(c) is None]
    missing += [f"{CNI_BIN_DIR / p}" for p in NEEDED_CNI_PLUGINS if not (CNI_BIN_DIR / p).is_file()]
    return missing


# ----------------------------------------------------------------------------- cleanup


def _mounts_under(*roots: Path) -> list[str]:
    """Mount points at or below any of ``roots``, deepest first."""
    # /proc/self/mountinfo has real paths (/run/netns/..., where containerd says /var/run/netns/...).
    prefixes = [os.path.realpath(r).rstrip("/") for r in roots]
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            # Field 5 is the mount point, octal-escaped (a space is \\040).
            point = line.split()[4].encode().decode("unicode_escape")
            if any(point == p or point.startswith(p + "/") for p in prefixes):
                found.append(point)
    return sorted(set(found), key=lambda p: p.count("/"), reverse=True)


def unmount_under(*roots: Path) -> None:
    """Unmount everything mounted at or below ``roots`` (lazily: a busy one goes once unused)."""
    for point in _mounts_under(*roots):
        _run(["umount", "--lazy", point], check=False)


def _processes_with_argument(argument: str) -> list[int]:
    """PIDs whose command line holds ``argument`` as one word (our own unique paths only)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argument.encode() in argv:
            pids.append(int(entry.name))
    return pids


def _kill_shims() -> None:
    """containerd's shims daemonize out of its process group; each names our socket."""
    for pid in _processes_with_argument(str(CONTAINERD_SOCKET)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)


def kube_chains_removal(saved: str) -> str:
    """An ``iptables-restore --noflush`` script removing every ``KUBE-*`` chain of ``iptables-save`` output.

    The jumps into them from other chains go first, then their rules, then the chains.
    """
    out: list[str] = []
    chains: list[str] = []
    jumps: list[str] = []
    for line in saved.splitlines():
        if line.startswith("*"):
            out.append(line)
            chains, jumps = [], []
        elif line.startswith(":KUBE-"):
            chains.append(line[1:].split()[0])
        elif line.startswith("-A ") and not line.split()[1].startswith("KUBE-") and " -j KUBE-" in line:
            jumps.append("-D " + line[3:])
        elif line == "COMMIT":
            out += jumps + [f"-F {c}" for c in chains] + [f"-X {c}" for c in chains] + [line]
    return "\n".join(out) + "\n"


def _remove_kube_chains() -> None:
    """The kubelet's own chains (KUBE-FIREWALL, KUBE-KUBELET-CANARY, ...): it has no cleanup of its own.

    Run after ``kube-proxy --cleanup``, with no other kubelet here (the lock), so every ``KUBE-*``
    chain left is the test node's.
    """
    for family in ("iptables", "ip6tables"):
        saved = _run([f"{family}-save"], check=False).stdout
        if ":KUBE-" in saved:
            subprocess.run(
                [f"{family}-restore", "--noflush"], input=kube_chains_removal(saved), text=True, check=False
            )


def _kill_pod_processes() -> list[Path]:
    """Kill what runs in the kubelet's pod cgroups; return the network namespaces it ran in.

    For a session that died: its shims are gone, but the containers live on under init. The
    namespace files are matched by inode, since containerd is no longer there to ask.
    """
    pids: set[int] = set()
    for hierarchy in CGROUP_ROOT.iterdir():
        for dirpath, _dirs, files in os.walk(hierarchy / "kubepods"):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError, ValueError):
                    pids.update(int(p) for p in Path(dirpath, "cgroup.procs").read_text().split())
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            inodes.add(os.stat(f"/proc/{pid}/ns/net").st_ino)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    host = os.stat("/proc/self/ns/net").st_ino
    if not NETNS_DIR.is_dir():
        return []
    return [p for p in NETNS_DIR.iterdir() if (ino := _inode(p)) in inodes and ino != host]


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _remove_netns(paths: list[Path]) -> None:
    unmount_under(*paths)
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


def _remove_cgroups(name: str = "kubepods") -> None:
    """The kubelet's pod cgroups in every hierarchy, leaves first (the kubelet leaves them)."""
    for hierarchy in CGROUP_ROOT.iterdir():
        top = hierarchy / name
        if not top.is_dir():
            continue
        for dirpath, _dirs, _files in sorted(os.walk(top), key=lambda w: w[0].count("/"), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(dirpath)


# -------------------------------------------------------------------------------- node


class Node:
    """A real node (containerd, kubelet, kube-proxy, CoreDNS, device plugin) and its cluster.

    After :meth:`start`:

    ``control_plane``  the node's :class:`ControlPlane` (``kubectl()``, ``run_helm()``, ``kubeconfig``)
    ``name``           the Node's name; ``ip`` its InternalIP (also the API server's address)
    ``gpu_uuids``      the device IDs of ``nvidia.com/gpu`` (the scenario's GPU UUIDs)
    ``images``         the built images; pause and workload are imported already
    ``pod_resources_socket``  the kubelet's PodResources socket
    ``startup_seconds``, ``phase_seconds``  measured start time, in total and per phase
    """

    def __init__(self, binaries: Binaries, images: Images, workdir: Path, scenario: str = SCENARIO) -> None:
        self.binaries = binaries
        self.images = images
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.scenario = scenario
        self.gpu_uuids = scenario_uuids(scenario)
        self.name = NODE_NAME
        self.ip = NODE_IP
        self.pod_resources_socket = POD_RESOURCES_SOCKET
        self.control_plane = ControlPlane(
            binaries, workdir / "controlplane", address=NODE_IP, with_nodes=True
        )
        self.processes: dict[str, ManagedProcess] = {}
        self.startup_seconds = 0.0
        self.phase_seconds: dict[str, float] = {}
        self.teardown_seconds: dict[str, float] = {}
        self.imported: list[str] = []
        self._sysctls: dict[str, str] = {}
        self._made_dirs: list[Path] = []
        self._lock: IO[bytes] | None = None
        self._pod_logs = workdir / "pod-logs"

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        """Bring the node up; return once it is Ready with its GPUs, Service routing and DNS."""
        t0 = time.monotonic()
        try:
            if missing := missing_prerequisites():
                raise NodeError(
                    "this machine cannot run the test node; missing: "
                    + ", ".join(missing)
                    + " (hack/ensure-system-deps.sh installs the packages)"
                )
            self._phase("lock", self._take_lock)
            self._phase("host", self._prepare_host)
            self._phase("control plane", self.control_plane.start)
            self._phase("containerd", self._start_containerd)
            self._phase(
                "images",
                lambda: [self.import_image(i.archive) for i in (self.images.pause, self.images.workload)],
            )
            self._phase("controllers", self._start_controllers)
            self._phase("kubelet", self._start_kubelet)
            self._phase("device plugin", self._start_device_plugin)
            self._phase("kube-proxy", self._start_kube_proxy)
            self._phase("coredns", self._start_coredns)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0

    def _phase(self, name: str, step: Callable[[], object]) -> None:
        t = time.monotonic()
        step()
        self.phase_seconds[name] = time.monotonic() - t

    def stop(self) -> None:
        """Tear everything down (idempotent; each step runs even when an earlier one failed)."""
        steps: dict[str, Callable[[], None]] = {
            "drain": self._drain,
            "controllers": lambda: self._stop("kube-controller-manager", "kube-scheduler"),
            "kube-proxy": self._stop_kube_proxy,
            "coredns, device plugin, kubelet": lambda: self._stop("coredns", "device-plugin", "kubelet"),
            "containerd": self._stop_containerd,
            # Before the bridge goes: the API server's own client uses its address to shut down.
            "control plane": self.control_plane.stop,
            "host": self._clean_host,
            "lock": self._release_lock,
        }
        errors = []
        for name, step in steps.items():
            t = time.monotonic()
            try:
                step()
            except Exception as exc:  # a failed step must not keep the next from cleaning up
                errors.append(f"{name}: {exc}")
            self.teardown_seconds[name] = time.monotonic() - t
        if errors:
            raise NodeError("node teardown: " + "; ".join(errors))

    def _stop(self, *names: str) -> None:
        for name in names:
            if (proc := self.processes.pop(name, None)) is not None:
                proc.stop()

    # -- host ------------------------------------------------------------------------

    def _take_lock(self) -> None:
        LOCK_PATH.parent.mkdir(parents=True, exist_ok=True)
        self._lock = LOCK_PATH.open("wb")
        lock = self._lock

        def locked() -> bool:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False
            return True

        what = f"{LOCK_PATH} (another test node on this machine)"
        wait_for(locked, timeout=LOCK_TIMEOUT_S, what=what, interval=1)

    def _release_lock(self) -> None:
        if self._lock is not None:
            self._lock.close()  # closing the file releases the flock
            self._lock = None

    def _prepare_host(self) -> None:
        """Clear what a session that died left behind, then set up the kubelet's dir and the bridge."""
        if _socket_answers(DEVICE_PLUGIN_DIR / "kubelet.sock"):
            raise NodeError(f"a kubelet runs on this machine ({DEVICE_PLUGIN_DIR}/kubelet.sock answers)")
        if KUBELET_ROOT.exists() and not (KUBELET_ROOT / MARKER).exists() and any(KUBELET_ROOT.iterdir()):
            raise NodeError(f"{KUBELET_ROOT} exists and is not the test node's; not touching it")
        self._clean_host()
        self._made_dirs = [d for d in MADE_DIRS if not d.exists()]
        for name in SYSCTLS:
            path = Path("/proc/sys") / name
            if path.exists():
                self._sysctls[name] = path.read_text().strip()
        KUBELET_ROOT.mkdir(parents=True, exist_ok=True)
        (KUBELET_ROOT / MARKER).touch()
        RUN_DIR.mkdir(parents=True, exist_ok=True)
        self._pod_logs.mkdir(parents=True, exist_ok=True)
        # The CNI bridge plugin would create the bridge with the first pod; the API server must
        # listen on its address before that.
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{NODE_IP}/{POD_SUBNET.split('/')[1]}", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])

    def _clean_host(self) -> None:
        """Remove every trace of a node on this machine: ours, or one whose session died."""
        # The pods' processes first: they may die with their shims, and then their namespaces
        # can no longer be told from anyone else's.
        stale_netns = _kill_pod_processes()
        _kill_shims()
        _remove_netns(stale_netns)
        unmount_under(KUBELET_ROOT, RUN_DIR, self.workdir / "containerd")
        if (KUBELET_ROOT / MARKER).exists():
            shutil.rmtree(KUBELET_ROOT, ignore_errors=True)
        shutil.rmtree(RUN_DIR, ignore_errors=True)
        # The images' unpacked layers; the logs beside them stay for a failure's post-mortem.
        shutil.rmtree(self.workdir / "containerd" / "root", ignore_errors=True)
        if CONTAINER_LOG_LINKS.is_dir():
            for link in CONTAINER_LOG_LINKS.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(str(self._pod_logs)):
                    link.unlink()
        if CNI_CACHE_DIR.is_dir():
            for cached in CNI_CACHE_DIR.glob(f"{CNI_NETWORK}-*"):
                cached.unlink()
        for directory in self._made_dirs:
            with contextlib.suppress(OSError):  # not empty: something else uses it too
                directory.rmdir()
        if Path("/sys/class/net", BRIDGE).exists():
            _run(["ip", "link", "delete", BRIDGE], check=False)
        _remove_kube_chains()
        _remove_cgroups()
        for name, value in self._sysctls.items():
            with contextlib.suppress(OSError):
                (Path("/proc/sys") / name).write_text(value)

    # -- containerd ------------------------------------------------------------------

    def _ctr(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        argv = ["ctr", f"--address={CONTAINERD_SOCKET}", "--namespace=k8s.io", *args]
        return _run(argv, check=check, timeout=timeout)

    def _start_containerd(self) -> None:
        directory = self.workdir / "containerd"
        cni_conf = self.workdir / "cni" / "net.d"
        cni_conf.mkdir(parents=True, exist_ok=True)
        (cni_conf / "10-gpuwarden.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": CNI_NETWORK,
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            # Pods need no way out of the machine, so no masquerading rules to leak.
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.workdir / "cni" / "ipam"),
                            },
                        }
                    ],
                },
                indent=2,
            )
        )
        cri = 'plugins."io.containerd.grpc.v1.cri"'
        config = directory / "config.toml"
        directory.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f"""version = 2
root = "{directory / "root"}"
state = "{RUN_DIR / "state"}"
# Plugins that would reach outside root/state (opt: /opt/containerd) or need other filesystems.
disabled_plugins = [
  "io.containerd.internal.v1.opt",
  "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs",
]

[grpc]
  address = "{CONTAINERD_SOCKET}"

[ttrpc]
  address = "{RUN_DIR / "containerd.sock.ttrpc"}"

[{cri}]
  sandbox_image = "{self.images.pause.name}"
  # This machine withholds CAP_SYS_RESOURCE, so runc cannot lower a container's oom_score_adj
  # below containerd's own (the pause container asks for -998): clamp instead of failing.
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        BinaryName = "{shutil.which("runc")}"
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni_conf}"
  # Per-registry settings (hosts.toml), read at every pull: trust_plain_http_registry.
  [{cri}.registry]
    config_path = "{directory / "certs.d"}"
"""
        )
        proc = self._spawn("containerd", [shutil.which("containerd") or "containerd", f"--config={config}"])
        self._wait(lambda: self._ctr("version", check=False).returncode == 0, "containerd", proc)
        plugins = self._ctr("plugins", "ls").stdout.splitlines()
        cri_status = [line.split() for line in plugins if " cri " in line]
        if not cri_status or cri_status[0][-1] != "ok":
            raise NodeError(f"containerd's CRI plugin did not load: {cri_status}\n{proc.log_tail()}")

    def trust_plain_http_registry(self, host: str) -> None:
        """Let the node's containerd pull from ``host`` (``HOST:PORT``, a test registry) over plain HTTP."""
        hosts = self.workdir / "containerd" / "certs.d" / host / "hosts.toml"
        hosts.parent.mkdir(parents=True, exist_ok=True)
        hosts.write_text(
            f'server = "http://{host}"\n\n[host."http://{host}"]\n  capabilities = ["pull", "resolve"]\n'
        )

    def import_image(self, archive: Path) -> list[str]:
        """Import an OCI archive into the node's containerd (unpacked for the CRI); return its names."""
        before = set(self._image_names())
        self._ctr("images", "import", "--snapshotter=overlayfs", str(archive))
        names = sorted(set(self._image_names()) - before) or self._names_in_archive(archive)
        self.imported += names
        return names

    def _image_names(self) -> list[str]:
        return self._ctr("images", "ls", "--quiet").stdout.split()

    @staticmethod
    def _names_in_archive(archive: Path) -> list[str]:
        import tarfile

        with tarfile.open(archive) as tar:
            member = tar.extractfile("index.json")
            index = json.load(member) if member is not None else {}
        return [
            m["annotations"]["org.opencontainers.image.ref.name"]
            for m in index.get("manifests", [])
            if "org.opencontainers.image.ref.name" in m.get("annotations", {})
        ]

    def _sandbox_netns(self) -> list[Path]:
        """Network namespace files of the CRI's pod sandboxes, asked of containerd while it runs."""
        listing = self._ctr("containers", "ls", "--quiet", check=False).stdout.split()
        paths = []
        for container in listing:
            info = self._ctr("containers", "info", container, check=False)
            with contextlib.suppress(ValueError):
                spec = json.loads(info.stdout).get("Spec") or {}
                for ns in (spec.get("linux") or {}).get("namespaces") or []:
                    if ns.get("type") == "network" and ns.get("path", "").startswith(str(NETNS_DIR)):
                        paths.append(Path(ns["path"]))
        return paths

    def _stop_containerd(self) -> None:
        if "containerd" not in self.processes:
            return
        # Sandboxes the kubelet did not stop (it died, or a pod did not go): their containers are
        # killed, and the network namespaces that containerd would have removed are removed here.
        netns = self._sandbox_netns()
        for task in self._ctr("tasks", "ls", "--quiet", check=False).stdout.split():
            self._ctr("tasks", "kill", "--signal=SIGKILL", task, check=False)
        self._stop("containerd")
        _kill_shims()
        _remove_netns(netns)

    # -- processes -------------------------------------------------------------------

    def _spawn(self, name: str, argv: list[str]) -> ManagedProcess:
        proc = ManagedProcess(name, argv, self.workdir / f"{name}.log", self.workdir)
        self.processes[name] = proc
        return proc

    def _wait(
        self, condition: Callable[[], bool], what: str, proc: ManagedProcess, interval: float = 0.1
    ) -> None:
        """Wait for ``condition``; a failure carries the process's log tail."""

        def exited() -> str | None:
            return None if proc.running() else f"{proc.name} exited with status {proc.proc.returncode}"

        try:
            wait_for(condition, timeout=START_TIMEOUT_S, what=what, alive=exited, interval=interval)
        except ControlPlaneError as exc:
            raise NodeError(f"{exc}\n--- {proc.name} log ({proc.log_path}) ---\n{proc.log_tail()}") from exc

    def _healthz(self, name: str, argv: list[str], url: str) -> None:
        """Start a component and wait for its health endpoint."""
        proc = self._spawn(name, argv)
        context = _unverified_tls() if url.startswith("https:") else None
        self._wait(lambda: _http_ok(url, context), f"{name} {url}", proc)

    def _write(self, name: str, document: Any) -> Path:
        path = self.workdir / name
        path.write_text(document if isinstance(document, str) else yaml.safe_dump(document, sort_keys=False))
        return path

    # -- controllers -----------------------------------------------------------------

    def _start_controllers(self) -> None:
        cp = self.control_plane
        assert cp.pki is not None
        self._start_controller(
            "kube-controller-manager",
            self.binaries.kube_controller_manager,
            # Signs the legacy token Secrets with the API server's key; each controller
            # then acts as its own ServiceAccount, as kubeadm runs it.
            f"--service-account-private-key-file={cp.pki.sa_private_key}",
            "--use-service-account-credentials=true",
            # Published as every namespace's kube-root-ca.crt, which projected tokens mount.
            f"--root-ca-file={cp.pki.ca_cert}",
            "--cluster-name=gpuwarden-test",
        )
        self._start_controller("kube-scheduler", self.binaries.kube_scheduler)

    def _start_controller(self, name: str, binary: Path, *flags: str) -> None:
        """kube-controller-manager or kube-scheduler: user ``system:<name>``, serving on loopback."""
        kubeconfig = self.control_plane.client_kubeconfig(f"system:{name}")
        (port,) = free_ports(1)
        self._healthz(
            name,
            [
                str(binary),
                f"--kubeconfig={kubeconfig}",
                f"--authentication-kubeconfig={kubeconfig}",
                f"--authorization-kubeconfig={kubeconfig}",
                "--bind-address=127.0.0.1",
                f"--secure-port={port}",
                "--leader-elect=false",
                *flags,
                "--v=1",
            ],
            f"https://127.0.0.1:{port}/healthz",
        )

    # -- kubelet ---------------------------------------------------------------------

    def _start_kubelet(self) -> None:
        cp = self.control_plane
        (healthz_port,) = free_ports(1)
        config = self._write(
            "kubelet-config.yaml",
            {
                "apiVersion": "kubelet.config.k8s.io/v1beta1",
                "kind": "KubeletConfiguration",
                # This machine mounts cgroup v1; Kubernetes 1.35+ refuses it unless told.
                "failCgroupV1": False,
                "failSwapOn": False,
                "cgroupDriver": "cgroupfs",
                "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
                "address": NODE_IP,
                "port": 10250,
                "readOnlyPort": 0,
                "healthzBindAddress": "127.0.0.1",
                "healthzPort": healthz_port,
                "authentication": {
                    "anonymous": {"enabled": False},
                    "webhook": {"enabled": True},
                    "x509": {"clientCAFile": str(cp.ca_path)},
                },
                "authorization": {"mode": "Webhook"},
                "clusterDomain": CLUSTER_DOMAIN,
                "clusterDNS": [CLUSTER_DNS_IP],
                "podLogsDir": str(self._pod_logs),
                # Imported images can never be pulled again: image GC must not delete them, and a
                # small CI disk must not evict the test pods.
                "imageGCHighThresholdPercent": 100,
                "imageGCLowThresholdPercent": 99,
                "evictionHard": {
                    "memory.available": "100Mi",
                    "nodefs.available": "1%",
                    "nodefs.inodesFree": "1%",
                    "imagefs.available": "1%",
                },
                # The Node's status (and so its GPUs once the device plugin registers) within 2 s.
                "nodeStatusUpdateFrequency": "2s",
                "serializeImagePulls": False,
                "rotateCertificates": False,
                "staticPodPath": "",
            },
        )
        kubeconfig = cp.client_kubeconfig(f"system:node:{NODE_NAME}", ["system:nodes"])
        proc = self._spawn(
            "kubelet",
            [
                str(self.binaries.kubelet),
                f"--config={config}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={KUBELET_ROOT}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={NODE_IP}",
                "--v=2",
            ],
        )
        healthz = f"http://127.0.0.1:{healthz_port}/healthz"
        self._wait(lambda: _http_ok(healthz), f"the kubelet's {healthz}", proc)
        self._wait(self.ready, f"Node {NODE_NAME} Ready", proc, interval=API_POLL_INTERVAL_S)

    def node_object(self) -> dict[str, Any] | None:
        """The Node as the API server has it (None before it registers)."""
        node: dict[str, Any] | None = self.control_plane.get_json(f"/api/v1/nodes/{NODE_NAME}")
        return node if node and node.get("kind") == "Node" else None

    def ready(self) -> bool:
        """Whether the Node's Ready condition is True."""
        node = self.node_object() or {}
        conditions = node.get("status", {}).get("conditions", [])
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)

    def allocatable_gpus(self) -> int:
        """``nvidia.com/gpu`` in the Node's allocatable (what the device plugin advertised)."""
        node = self.node_object() or {}
        return int(node.get("status", {}).get("allocatable", {}).get(RESOURCE_NAME, "0"))

    # -- device plugin ---------------------------------------------------------------

    def _start_device_plugin(self) -> None:
        proc = self._spawn(
            "device-plugin",
            [
                sys.executable,
                str(Path(__file__).with_name("deviceplugin.py")),
                f"--scenario={self.scenario}",
                f"--plugin-dir={DEVICE_PLUGIN_DIR}",
            ],
        )
        want = len(self.gpu_uuids)
        self._wait(
            lambda: self.allocatable_gpus() == want,
            f"{want} {RESOURCE_NAME} allocatable on {NODE_NAME}",
            proc,
            interval=API_POLL_INTERVAL_S,
        )

    # -- kube-proxy ------------------------------------------------------------------

    def _start_kube_proxy(self) -> None:
        healthz_port, metrics_port = free_ports(2)
        config = self._write(
            "kube-proxy-config.yaml",
            {
                "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
                "kind": "KubeProxyConfiguration",
                "clientConnection": {
                    "kubeconfig": str(self.control_plane.client_kubeconfig("system:kube-proxy"))
                },
                "mode": "iptables",
                "hostnameOverride": NODE_NAME,
                "clusterCIDR": POD_SUBNET,
                "healthzBindAddress": f"127.0.0.1:{healthz_port}",
                "metricsBindAddress": f"127.0.0.1:{metrics_port}",
                # No route_localnet for NodePorts on 127.0.0.1, and the machine's conntrack
                # table size and timeouts left as they are.
                "iptables": {"localhostNodePorts": False},
                "nodePortAddresses": ["primary"],
                "conntrack": {"maxPerCore": 0, "tcpEstablishedTimeout": "0s", "tcpCloseWaitTimeout": "0s"},
            },
        )
        self._healthz(
            "kube-proxy",
            [str(self.binaries.kube_proxy), f"--config={config}", "--v=1"],
            f"http://127.0.0.1:{healthz_port}/healthz",
        )

    def _stop_kube_proxy(self) -> None:
        if "kube-proxy" not in self.processes:
            return
        self._stop("kube-proxy")
        # Removes every KUBE-* chain and rule kube-proxy made (iptables, and nftables/ipvs if any).
        _run([str(self.binaries.kube_proxy), "--cleanup", "--v=1"], check=False)

    # -- CoreDNS ---------------------------------------------------------------------

    def _start_coredns(self) -> None:
        cp = self.control_plane
        dns_port, health_port, ready_port = free_ports(3)
        user = "gpuwarden:coredns"
        # What CoreDNS's own deployment grants it, for the kubernetes plugin's watches; the
        # Service has no selector (CoreDNS runs on the host), so its EndpointSlice is ours.
        manifests = [
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRole",
                "metadata": {"name": user},
                "rules": [
                    {
                        "apiGroups": [""],
                        "resources": ["endpoints", "services", "pods", "namespaces"],
                        "verbs": ["list", "watch"],
                    },
                    {
                        "apiGroups": ["discovery.k8s.io"],
                        "resources": ["endpointslices"],
                        "verbs": ["list", "watch"],
                    },
                ],
            },
            {
                "apiVersion": "rbac.authorization.k8s.io/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": user},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
                "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
            },
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {
                    "name": "kube-dns",
                    "namespace": "kube-system",
                    "labels": {"k8s-app": "kube-dns"},
                },
                "spec": {
                    "clusterIP": CLUSTER_DNS_IP,
                    "ports": [
                        {"name": "dns", "port": 53, "protocol": "UDP"},
                        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                    ],
                },
            },
            {
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {
                    "name": "kube-dns-host",
                    "namespace": "kube-system",
                    "labels": {"kubernetes.io/service-name": "kube-dns"},
                },
                "addressType": "IPv4",
                "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}, "nodeName": NODE_NAME}],
                "ports": [
                    {"name": "dns", "port": dns_port, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": dns_port, "protocol": "TCP"},
                ],
            },
        ]
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(manifests), check=True)
        kubeconfig = cp.client_kubeconfig(user)
        corefile = self._write(
            "Corefile",
            f""".:{dns_port} {{
    bind {NODE_IP}
    errors
    health 127.0.0.1:{health_port}
    ready 127.0.0.1:{ready_port}
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {kubeconfig} gpuwarden-test
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
    }}
    cache 30
}}
""",
        )
        # /ready answers once the kubernetes plugin has synced its watches.
        self._healthz(
            "coredns",
            [str(self.binaries.coredns), f"-conf={corefile}"],
            f"http://127.0.0.1:{ready_port}/ready",
        )

    # -- teardown --------------------------------------------------------------------

    def _drain(self) -> None:
        """Delete every pod through the API while the kubelet runs, so it stops their sandboxes.

        The controllers go first (nothing recreates the pods); the kubelet then kills the
        containers and tears down each sandbox's network (CNI DEL) before the pod is gone.
        """
        if self.control_plane.apiserver is None or "kubelet" not in self.processes:
            return
        self._stop("kube-controller-manager", "kube-scheduler")
        self.control_plane.kubectl(
            "delete",
            "pods",
            "--all",
            "--all-namespaces",
            "--grace-period=1",
            "--wait=true",
            "--timeout=120s",
            timeout=150,
        )

    # -- for tests -------------------------------------------------------------------

    def logs(self) -> str:
        """Tails of every node component's log (for failure messages)."""
        parts = [self.control_plane.logs()]
        for proc in self.processes.values():
            parts.append(f"--- {proc.name} log ({proc.log_path}) ---\n{proc.log_tail(40)}")
        return "\n".join(parts)
