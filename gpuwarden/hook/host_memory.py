"""Resident host memory of a process and its descendants (the data-loader workers), from /proc.

Summing RSS counts each page a forked worker still shares copy-on-write with its parent once per
process, so the total overstates what the pod uses (its cgroup's ``memory.current`` is the truth for
that); what the hook's readings are for is growth, and a worker's leak grows its own RSS only.
"""

from __future__ import annotations

import os
from pathlib import Path

PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def _parent_pids(proc: Path) -> dict[int, int]:
    """pid -> parent pid of every process /proc shows (a container's own when in its PID namespace)."""
    parents: dict[int, int] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited while we looked
            continue
        # The command in parentheses may hold spaces and parentheses: fields follow the last ')'.
        fields = stat[stat.rfind(")") + 2 :].split()
        parents[int(entry.name)] = int(fields[1])
    return parents


def _rss_bytes(proc: Path, pid: int) -> int:
    try:
        return int((proc / str(pid) / "statm").read_text().split()[1]) * PAGE_BYTES
    except (OSError, IndexError, ValueError):  # exited while we looked
        return 0


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
