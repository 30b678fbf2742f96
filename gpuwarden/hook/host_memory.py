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
