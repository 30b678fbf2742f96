"""Which container a process runs in, and how much host memory each pod uses, from cgroups.

``/proc/<pid>/cgroup`` names the cgroup of a process; the kubelet lays pods out
as ``…/pod<uid>/<container>`` whatever the driver and runtime, only the spelling
differs:

- systemd driver: ``/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid>.slice/
  cri-containerd-<id>.scope`` (``crio-<id>.scope`` for CRI-O, ``docker-<id>.scope`` for Docker),
  with the UID's dashes written as underscores;
- cgroupfs driver: ``/kubepods/burstable/pod<uid>/<id>``;
- outside Kubernetes, Docker's ``/docker/<id>`` and ``/system.slice/docker-<id>.scope``.

Paths may be prefixed (kind nodes nest ``/kubelet.slice/kubelet-kubepods.slice``) or
relative to the reader's cgroup namespace (``/../../kubepods.slice/…``), so segments
are matched wherever they are, never anchored at the root.

The agent needs the host's view: ``hostPID`` (NVML reports host PIDs) and the host's
``/sys/fs/cgroup`` mounted (a container's own cgroup namespace shows only itself).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# A pod's cgroup: "pod<uid>" (cgroupfs) or "kubepods[-<qos>]-pod<uid>.slice" (systemd; kind
# prefixes "kubelet-"). Static pods have 32-hex-digit UIDs (a config hash), not RFC 4122 ones.
_POD_SEGMENT = re.compile(
    r"^(?:[a-z-]*-)?pod(?P<uid>[0-9a-fA-F][0-9a-fA-F_-]{30,35})(?:\.slice)?$",
)
# A container's cgroup: "<runtime>-<id>.scope" (systemd) or the bare 64-hex-digit id (cgroupfs).
# "crio-conmon-<id>.scope", CRI-O's monitor process, deliberately does not match.
_CONTAINER_SEGMENT = re.compile(
    r"^(?:(?P<runtime>cri-containerd|crio|docker|libpod)-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$"
)
_RUNTIMES = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker", "libpod": "podman"}

# The kubelet's top-level cgroups: "kubepods" (cgroupfs), "kubepods.slice" (systemd),
# and kind's "kubelet.slice/kubelet-kubepods.slice".
_KUBEPODS_PREFIXES = ("kubepods", "kubelet")
_QOS_DIRS = {"besteffort", "burstable", "guaranteed"}
_MAX_POD_DEPTH = 4


@dataclass(frozen=True)
class CgroupIdentity:
    """Where a process lives: a pod's container, a container outside Kubernetes, or the host."""

    pod_uid: str | None = None
    """The pod's UID with dashes (``1b4e28ba-2fa1-11d2-883f-0016d3cca427``), or None outside pods."""
    container_id: str | None = None
    """The runtime's 64-hex-digit container ID, or None when the process is in no container's cgroup."""
    runtime: str | None = None
    """``containerd``, ``cri-o``, ``docker``, ``podman``, or None when the path does not say."""

    @property
    def in_pod(self) -> bool:
        """Whether the process belongs to a Kubernetes pod."""
        return self.pod_uid is not None


HOST = CgroupIdentity()
"""A process in no container: a host daemon, or anything the kubelet did not start."""


def normalize_pod_uid(raw: str) -> str:
    """The UID as the API server spells it: systemd slice names write its dashes as underscores."""
    return raw.replace("_", "-").lower()


def parse_cgroup_path(path: str) -> CgroupIdentity:
    """Find a pod UID and container ID in one cgroup path; :data:`HOST` when it names neither."""
    segments = [s for s in path.split("/") if s and s != ".."]
    for i, segment in enumerate(segments):
        pod = _POD_SEGMENT.match(segment)
        if pod is None:
            continue
        uid = normalize_pod_uid(pod["uid"])
        container = _CONTAINER_SEGMENT.match(segments[i + 1]) if i + 1 < len(segments) else None
        if container is None:
            # the pod's own cgroup, or a helper (crio-conmon) beside its containers
            return CgroupIdentity(pod_uid=uid)
        return CgroupIdentity(uid, container["id"], _runtime(container["runtime"]))
    # Not a pod: a Docker container outside Kubernetes ("/docker/<id>" or "docker-<id>.scope").
    for parent, segment in zip(["", *segments], segments, strict=False):
        container = _CONTAINER_SEGMENT.match(segment)
        if container is not None and (container["runtime"] or parent == "docker"):
            return CgroupIdentity(
                container_id=container["id"], runtime=_runtime(container["runtime"] or "docker")
            )
    return HOST


def _runtime(prefix: str | None) -> str | None:
    return _RUNTIMES.get(prefix) if prefix else None


def parse_proc_cgroup(text: str) -> CgroupIdentity:
    """Parse the whole of ``/proc/<pid>/cgroup``, cgroup v1 (a line per hierarchy) or v2 (``0::<path>``).

    Under v1 every hierarchy usually names the same container; the most specific
    answer wins (pod and container, then pod, then container) so that one
    hierarchy left at the root (e.g. ``net_cls``) does not hide the others.
    """
    best = HOST
    for line in text.splitlines():
        # hierarchy-ID:controller-list:cgroup-path; the path itself may contain ':'
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        found = parse_cgroup_path(parts[2])
        if _rank(found) > _rank(best):
            best = found
    return best


def _rank(identity: CgroupIdentity) -> int:
    return 2 * (identity.pod_uid is not None) + (identity.container_id is not None)


class CgroupReader:
    """Reads process cgroups under ``proc_root`` and pod memory under ``cgroup_root``.

    Both roots are parameters so that the agent can read the host's trees where the
    DaemonSet mounts them (e.g. ``/host/sys/fs/cgroup``), and tests a temp tree.
    """

    def __init__(
        self,
        proc_root: str | os.PathLike[str] = "/proc",
        cgroup_root: str | os.PathLike[str] = "/sys/fs/cgroup",
    ) -> None:
        self._proc = Path(proc_root)
        self._cgroup = Path(cgroup_root)

    def identity(self, pid: int) -> CgroupIdentity | None:
        """Where ``pid`` lives; None when it cannot be read (gone, or not in our PID view)."""
        try:
            text = (self._proc / str(pid) / "cgroup").read_text()
        except OSError:
            return None
        return parse_proc_cgroup(text)

    @property
    def unified(self) -> bool:
        """Whether the host runs cgroup v2 (one hierarchy) rather than v1."""
        return (self._cgroup / "cgroup.controllers").exists()

    def pod_memory(self) -> dict[str, int]:
        """Host memory in bytes per pod UID, for every pod cgroup on the node.

        v2 reads ``memory.current``, v1 ``memory/…/memory.usage_in_bytes``; both count
        page cache, as the kernel's own limit enforcement does. A pod whose file
        cannot be read (it just went away) is left out rather than reported as 0.
        """
        if self.unified:
            base, filename = self._cgroup, "memory.current"
        else:
            base, filename = self._cgroup / "memory", "memory.usage_in_bytes"
        usage: dict[str, int] = {}
        for uid, directory in _pod_cgroups(base):
            try:
                usage[uid] = int((directory / filename).read_text())
            except (OSError, ValueError):
                continue
        return usage


def _pod_cgroups(base: Path) -> list[tuple[str, Path]]:
    """Every pod cgroup below the kubelet's top-level cgroups, at most a few levels down."""
    found: list[tuple[str, Path]] = []
    stack = [(d, 1) for d in _subdirs(base) if d.name.startswith(_KUBEPODS_PREFIXES)]
    while stack:
        directory, depth = stack.pop()
        pod = _POD_SEGMENT.match(directory.name)
        if pod is not None:
            found.append((normalize_pod_uid(pod["uid"]), directory))
            continue
        if depth < _MAX_POD_DEPTH:
            stack.extend(
                (d, depth + 1)
                for d in _subdirs(directory)
                if d.name.startswith(_KUBEPODS_PREFIXES) or d.name in _QOS_DIRS or _POD_SEGMENT.match(d.name)
            )
    return sorted(found)


def _subdirs(directory: Path) -> list[Path]:
    try:
        return [d for d in directory.iterdir() if d.is_dir()]
    except OSError:
        return []
