"""Resident host memory of a process and its descendants (the data-loader workers), from /proc.

Summing RSS counts each page a forked worker still shares copy-on-write with its parent once per
process, so the total overstates what the pod uses (its cgroup's ``memory.current`` is the truth for
that); what the hook's readings are for is growth, and a worker's leak grows its own RSS only.
"""

from __future__ import annotations

import os
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read()
    except OSError:  # the process exited while we looked
        return None


def _parent_pids(proc: Path) -> dict[int, int]:
    """pid -> parent pid of every process /proc shows (a container's own when in its PID namespace)."""
    parents: dict[int, int] = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        stat = _read(f"{proc}/{name}/stat")
        if stat is None:
            continue
        # The command in parentheses may hold spaces and parentheses: fields follow the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split(maxsplit=2)
        parents[int(name)] = int(fields[1])
    return parents


def _rss_bytes(proc: Path, pid: int) -> int:
    statm = _read(f"{proc}/{pid}/statm")
    return int(statm.split()[1]) * PAGE_BYTES if statm else 0


def descendants(pid: int, proc: Path = Path("/proc")) -> list[int]:
    """The processes below ``pid`` (children, grandchildren…), in no particular order."""
    children: dict[int, list[int]] = {}
    for child, parent in _parent_pids(proc).items():
        children.setdefault(parent, []).append(child)
    found: list[int] = []
    todo = [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found.extend(kids)
        todo.extend(kids)
    return found


def tree_rss_bytes(pid: int | None = None, proc: Path = Path("/proc")) -> int | None:
    """RSS of ``pid`` (this process by default) plus its descendants'; ``None`` without /proc.

    Scans /proc once (a few milliseconds with hundreds of processes; the hook reads every few seconds).
    """
    pid = os.getpid() if pid is None else pid
    if not (proc / str(pid) / "statm").exists():
        return None
    return sum(_rss_bytes(proc, p) for p in [pid, *descendants(pid, proc)])


def memory_limit_bytes(
    pid: int | None = None, proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")
) -> int | None:
    """The memory limit ``pid`` (this process by default) runs under, as the job sees it; None unknown.

    The smallest ``memory.max`` (cgroup v2) or ``memory/…/memory.limit_in_bytes`` (cgroup v1) of the
    process's own cgroup, from ``/proc/<pid>/cgroup``, and of each ancestor the mount shows (a pod's
    limit sits on the pod's cgroup, a container's on its own; inside a cgroup namespace the
    container's is the root). ``max``, or a v1 figure above the node's memory (v1 spells "no limit"
    as a page-rounded 2**63 - 1), is no limit: then the node's ``MemTotal``, from ``<proc>/meminfo``.
    ``proc`` and ``cgroup`` are the mounts' roots (tests give a tmp directory).
    """
    pid = os.getpid() if pid is None else pid
    total = _mem_total(proc)
    limits = [
        limit for limit in _cgroup_limits(_read(f"{proc}/{pid}/cgroup") or "", cgroup) if limit is not None
    ]
    if total is not None:
        limits = [limit for limit in limits if limit < total] or [total]
    return min(limits, default=None)


def _mem_total(proc: Path) -> int | None:
    for line in (_read(f"{proc}/meminfo") or "").splitlines():
        name, _, value = line.partition(":")
        if name == "MemTotal" and value.split()[1:] == ["kB"]:
            return int(value.split()[0]) * 1024
    return None


def _cgroup_limits(membership: str, cgroup: Path) -> list[int | None]:
    """The limits on the path of each hierarchy ``membership`` (``/proc/<pid>/cgroup``) names, leaf first."""
    limits: list[int | None] = []
    for line in membership.splitlines():
        hierarchy, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hierarchy == "0" and not controllers:
            base, name = cgroup, "memory.max"  # v2: the unified hierarchy
        elif "memory" in controllers.split(","):
            base, name = cgroup / "memory", "memory.limit_in_bytes"  # v1: the memory controller's own
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        for depth in range(len(parts), -1, -1):
            limits.append(_limit(base.joinpath(*parts[:depth]) / name))
    return limits


def _limit(path: Path) -> int | None:
    text = (_read(str(path)) or "").strip()
    # "max" (v2), absent, or v1's page-rounded 2**63 - 1: no limit here.
    return int(text) if text.isdigit() and int(text) < 2**62 else None
