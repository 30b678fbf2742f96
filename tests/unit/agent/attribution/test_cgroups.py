"""/proc/<pid>/cgroup parsing and pod memory, over temp trees shaped like real nodes."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuwarden.agent.attribution.cgroups import (
    HOST,
    CgroupIdentity,
    CgroupReader,
    parse_cgroup_path,
    parse_proc_cgroup,
)

UID = "1b4e28ba-2fa1-11d2-883f-0016d3cca427"
UID_ = UID.replace("-", "_")  # as systemd slice names spell it
STATIC_UID = "5b4e8a6f9c3d2e1f0a9b8c7d6e5f4a3b"  # a static pod's config hash
CID = "4f3a" + "0123456789abcdef" * 3 + "deadbeefcafe"
assert len(CID) == 64

V1_CONTROLLERS = ["memory", "cpu,cpuacct", "devices", "pids", "blkio", "name=systemd"]


def v1(path: str) -> str:
    """A cgroup v1 file: the same path in every hierarchy, plus the unified line of hybrid hosts."""
    lines = [f"{12 - i}:{c}:{path}" for i, c in enumerate(V1_CONTROLLERS)]
    return "\n".join([*lines, "0::/"]) + "\n"


def v2(path: str) -> str:
    return f"0::{path}\n"


CASES: list[tuple[str, str, CgroupIdentity]] = [
    (
        "v2 systemd containerd",
        v2(
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CgroupIdentity(UID, CID, "containerd"),
    ),
    (
        "v2 systemd containerd guaranteed",
        v2(f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope"),
        CgroupIdentity(UID, CID, "containerd"),
    ),
    (
        "v2 seen from another cgroup namespace",
        v2(
            f"/../../kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CgroupIdentity(UID, CID, "containerd"),
    ),
    (
        "v2 kind node",
        v2(
            "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/"
            f"kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CgroupIdentity(UID, CID, "containerd"),
    ),
    (
        "v2 systemd CRI-O",
        v2(f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-{CID}.scope"),
        CgroupIdentity(UID, CID, "cri-o"),
    ),
    (
        "v2 CRI-O conmon belongs to the pod, not a container",
        v2(
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/crio-conmon-{CID}.scope"
        ),
        CgroupIdentity(pod_uid=UID),
    ),
    (
        "v2 cgroupfs containerd",
        v2(f"/kubepods/burstable/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, None),
    ),
    (
        "v2 systemd container with a nested cgroup",
        v2(f"/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{CID}.scope/init.scope"),
        CgroupIdentity(UID, CID, "containerd"),
    ),
    (
        "v1 systemd containerd",
        v1(
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{CID}.scope"
        ),
        CgroupIdentity(UID, CID, "containerd"),
    ),
    (
        "v1 cgroupfs containerd",
        v1(f"/kubepods/burstable/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, None),
    ),
    (
        "v1 cgroupfs guaranteed",
        v1(f"/kubepods/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, None),
    ),
    (
        "v1 systemd CRI-O",
        v1(f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/crio-{CID}.scope"),
        CgroupIdentity(UID, CID, "cri-o"),
    ),
    (
        "v1 systemd Docker (cri-dockerd)",
        v1(
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/docker-{CID}.scope"
        ),
        CgroupIdentity(UID, CID, "docker"),
    ),
    (
        "v1 static pod",
        v1(f"/kubepods/burstable/pod{STATIC_UID}/{CID}"),
        CgroupIdentity(STATIC_UID, CID, None),
    ),
    (
        "v1 kind node inside Docker",
        v1(f"/docker/{'a' * 64}/kubepods/besteffort/pod{UID}/{CID}"),
        CgroupIdentity(UID, CID, None),
    ),
    ("v1 Docker outside Kubernetes", v1(f"/docker/{CID}"), CgroupIdentity(None, CID, "docker")),
    (
        "v2 Docker outside Kubernetes",
        v2(f"/system.slice/docker-{CID}.scope"),
        CgroupIdentity(None, CID, "docker"),
    ),
    ("v2 host service", v2("/system.slice/nvidia-persistenced.service"), HOST),
    ("v2 host init", v2("/init.scope"), HOST),
    ("v1 host user session", v1("/user.slice/user-0.slice/session-3.scope"), HOST),
    ("empty", "", HOST),
]


@pytest.mark.parametrize(("text", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_parse_proc_cgroup(text: str, expected: CgroupIdentity) -> None:
    assert parse_proc_cgroup(text) == expected


def test_v1_hierarchy_left_at_root_does_not_hide_the_container() -> None:
    text = f"3:net_cls,net_prio:/\n2:memory:/kubepods/burstable/pod{UID}/{CID}\n1:name=systemd:/\n"
    assert parse_proc_cgroup(text) == CgroupIdentity(UID, CID, None)


def test_malformed_lines_are_skipped() -> None:
    text = f"garbage\n\n0::/kubepods/pod{UID}/{CID}\n"
    assert parse_proc_cgroup(text) == CgroupIdentity(UID, CID, None)


def test_a_path_with_a_colon_is_kept_whole() -> None:
    # the path is everything after the second ':'
    assert parse_proc_cgroup(f"0::/kubepods/pod{UID}/{CID}:x\n") == CgroupIdentity(pod_uid=UID)


def test_pod_without_a_container_segment() -> None:
    assert parse_cgroup_path(f"/kubepods/burstable/pod{UID}") == CgroupIdentity(pod_uid=UID)
    assert CgroupIdentity(pod_uid=UID).in_pod
    assert not HOST.in_pod


_FORMS: list[Callable[[str, str], str]] = [
    lambda u, c: (
        f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u.replace('-', '_')}.slice/"
        f"cri-containerd-{c}.scope"
    ),
    lambda u, c: f"/kubepods.slice/kubepods-pod{u.replace('-', '_')}.slice/crio-{c}.scope",
    lambda u, c: (
        f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{u.replace('-', '_')}.slice/"
        f"docker-{c}.scope"
    ),
    lambda u, c: f"/kubepods/besteffort/pod{u}/{c}",
    lambda u, c: f"/kubepods/pod{u}/{c}",
]


@given(
    pod_uid=st.uuids().map(str),
    container_id=st.binary(min_size=32, max_size=32).map(bytes.hex),
    form=st.sampled_from(_FORMS),
    version=st.sampled_from([v1, v2]),
)
def test_every_form_round_trips(
    pod_uid: str, container_id: str, form: Callable[[str, str], str], version: Callable[[str], str]
) -> None:
    found = parse_proc_cgroup(version(form(pod_uid, container_id)))
    assert (found.pod_uid, found.container_id) == (pod_uid, container_id)


# --- the reader over temp trees ---


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_identity_reads_proc(tmp_path: Path) -> None:
    _write(tmp_path / "proc" / "4242" / "cgroup", v2(f"/kubepods/pod{UID}/{CID}"))
    reader = CgroupReader(proc_root=tmp_path / "proc", cgroup_root=tmp_path / "cg")

    assert reader.identity(4242) == CgroupIdentity(UID, CID, None)
    assert reader.identity(4243) is None  # gone, or not in our PID namespace


def test_pod_memory_cgroup_v2_systemd(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpuset cpu io memory pids\n")
    _write(root / "kubepods.slice" / "memory.current", "999999\n")  # all pods together: not a pod
    burstable = root / "kubepods.slice" / "kubepods-burstable.slice"
    pod = burstable / f"kubepods-burstable-pod{UID_}.slice"
    _write(pod / "memory.current", "123456789\n")
    _write(pod / f"cri-containerd-{CID}.scope" / "memory.current", "100000000\n")  # counted in the pod's
    other = str(uuid.UUID(int=7))
    _write(
        root / "kubepods.slice" / f"kubepods-pod{other.replace('-', '_')}.slice" / "memory.current", "42\n"
    )
    _write(root / "system.slice" / "containerd.service" / "memory.current", "5\n")

    reader = CgroupReader(proc_root=tmp_path / "proc", cgroup_root=root)

    assert reader.unified
    assert reader.pod_memory() == {UID: 123456789, other: 42}


def test_pod_memory_cgroup_v1_cgroupfs(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    kubepods = root / "memory" / "kubepods"
    _write(kubepods / "memory.usage_in_bytes", "999999\n")
    _write(kubepods / "burstable" / f"pod{UID}" / "memory.usage_in_bytes", "2048\n")
    _write(kubepods / "burstable" / f"pod{UID}" / CID / "memory.usage_in_bytes", "1024\n")
    _write(kubepods / f"pod{STATIC_UID}" / "memory.usage_in_bytes", "4096\n")
    (root / "cpu" / "kubepods").mkdir(parents=True)  # other controllers are not read

    reader = CgroupReader(cgroup_root=root)

    assert not reader.unified
    assert reader.pod_memory() == {UID: 2048, STATIC_UID: 4096}


def test_pod_memory_kind_layout(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "memory\n")
    pod = (
        root
        / "kubelet.slice"
        / "kubelet-kubepods.slice"
        / "kubelet-kubepods-besteffort.slice"
        / f"kubelet-kubepods-besteffort-pod{UID_}.slice"
    )
    _write(pod / "memory.current", "77\n")

    assert CgroupReader(cgroup_root=root).pod_memory() == {UID: 77}


def test_unreadable_pod_memory_is_left_out_not_zero(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "memory\n")
    (root / "kubepods" / f"pod{UID}").mkdir(parents=True)  # memory controller not enabled there
    _write(root / "kubepods" / f"pod{STATIC_UID}" / "memory.current", "max\n")

    assert CgroupReader(cgroup_root=root).pod_memory() == {}


def test_no_cgroup_tree_at_all(tmp_path: Path) -> None:
    assert CgroupReader(cgroup_root=tmp_path / "absent").pod_memory() == {}
