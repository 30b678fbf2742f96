"""Host RSS from /proc: a child that holds memory counts in its parent's tree; the limit from the cgroup."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gpuwarden.hook import tree_rss_bytes
from gpuwarden.hook.host_memory import descendants, memory_limit_bytes

HELD = 64 * 2**20

CHILD = f"""
import sys
held = b"x" * {HELD}  # written, so resident
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_child_holding_memory_counts_in_the_tree() -> None:
    before = tree_rss_bytes()
    assert before is not None
    assert before > 0
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        assert child.stdout.readline() == b"ready\n"
        assert child.pid in descendants(os.getpid())
        after = tree_rss_bytes()
        assert after is not None
        assert after - before >= HELD
    finally:
        child.kill()
        child.wait()


def test_no_such_process_reads_none() -> None:
    assert tree_rss_bytes(pid=2**31 - 2) is None


GI = 2**30


def machine(
    tmp_path: Path, membership: str, limits: dict[str, str], mem_total_kb: int | None = 64 * 2**20
) -> int:
    """A /proc and /sys/fs/cgroup under ``tmp_path``: process 42 in ``membership``, limit files as given."""
    (tmp_path / "proc" / "42").mkdir(parents=True)
    (tmp_path / "proc" / "42" / "cgroup").write_text(membership)
    if mem_total_kb is not None:
        (tmp_path / "proc" / "meminfo").write_text(f"MemTotal:       {mem_total_kb} kB\nMemFree:  1 kB\n")
    for name, text in limits.items():
        path = tmp_path / "cgroup" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")
    return 42


def limit(tmp_path: Path) -> int | None:
    return memory_limit_bytes(42, tmp_path / "proc", tmp_path / "cgroup")


def test_cgroup_v2_reads_the_process_own_memory_max(tmp_path: Path) -> None:
    pod = "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod1.slice"
    machine(tmp_path, f"0::/{pod}/cri-containerd-abc.scope\n", {
        f"{pod}/cri-containerd-abc.scope/memory.max": str(16 * GI),
        f"{pod}/memory.max": str(20 * GI),
        "kubepods.slice/memory.max": "max",
    })  # fmt: skip
    assert limit(tmp_path) == 16 * GI


def test_cgroup_v2_a_pod_limit_above_an_unlimited_container_counts(tmp_path: Path) -> None:
    machine(tmp_path, "0::/pod/ctr\n", {"pod/ctr/memory.max": "max", "pod/memory.max": str(12 * GI)})
    assert limit(tmp_path) == 12 * GI


def test_cgroup_v2_inside_a_cgroup_namespace_the_root_is_the_container(tmp_path: Path) -> None:
    machine(tmp_path, "0::/\n", {"memory.max": str(8 * GI)})
    assert limit(tmp_path) == 8 * GI


def test_no_limit_is_the_nodes_memory(tmp_path: Path) -> None:
    machine(tmp_path, "0::/pod/ctr\n", {"pod/ctr/memory.max": "max"}, mem_total_kb=64 * 2**20)
    assert limit(tmp_path) == 64 * GI


def test_cgroup_v1_reads_the_memory_controllers_limit(tmp_path: Path) -> None:
    membership = "12:cpu,cpuacct:/kubepods/pod1/abc\n11:memory:/kubepods/pod1/abc\n1:name=systemd:/x\n"
    machine(tmp_path, membership, {
        "memory/kubepods/pod1/abc/memory.limit_in_bytes": str(6 * GI),
        "memory/kubepods/memory.limit_in_bytes": "9223372036854771712",  # v1's "no limit"
        "cpu,cpuacct/kubepods/pod1/abc/memory.max": str(GI),  # not the memory controller's: ignored
    })  # fmt: skip
    assert limit(tmp_path) == 6 * GI


def test_cgroup_v1_unlimited_is_the_nodes_memory(tmp_path: Path) -> None:
    machine(tmp_path, "4:memory:/a\n", {"memory/a/memory.limit_in_bytes": "9223372036854771712"})
    assert limit(tmp_path) == 64 * GI


def test_a_limit_above_the_nodes_memory_is_the_nodes(tmp_path: Path) -> None:
    machine(tmp_path, "0::/a\n", {"a/memory.max": str(100 * GI)})
    assert limit(tmp_path) == 64 * GI


def test_nothing_readable_is_unknown(tmp_path: Path) -> None:
    machine(tmp_path, "0::/a\n", {}, mem_total_kb=None)
    assert limit(tmp_path) is None
    assert memory_limit_bytes(7, tmp_path / "nowhere", tmp_path / "nowhere") is None


def test_this_process_has_a_limit_on_this_machine() -> None:
    """The real mounts: at most the node's memory, which every Linux machine reports."""
    found = memory_limit_bytes()
    assert found is not None
    assert 0 < found <= os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
