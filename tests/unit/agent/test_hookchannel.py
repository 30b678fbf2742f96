"""The hook channel as the agent and ``gpuwarden watch`` open it, on real Unix sockets: the hook socket
and the ``.control`` socket beside it, each run without (and said) when it cannot be opened, both
removed on the way out."""

from __future__ import annotations

import stat
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpuwarden.agent.hookchannel import hook_channel, open_hook_channel
from gpuwarden.agent.hookcontrol import control_path


async def test_both_sockets_are_open_inside_the_block_and_gone_after(
    socket_dir: Path,
) -> None:
    path = socket_dir / "hook.sock"
    complaints: list[str] = []
    async with open_hook_channel(
        hook_channel(path, CollectorRegistry()), who="agent", complain=complaints.append
    ) as hooks:
        assert hooks is not None
        assert hooks.path == path
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_ISSOCK(control_path(path).lstat().st_mode)
    assert complaints == []
    assert not path.exists()
    assert not control_path(path).exists()


async def test_without_control_only_the_hook_socket_opens(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    channel = hook_channel(path, CollectorRegistry())
    complaints: list[str] = []
    async with open_hook_channel(channel, who="watch", complain=complaints.append, control=False) as hooks:
        assert hooks is not None
        assert path.exists()
        assert not control_path(path).exists()
    assert complaints == []


async def test_a_hook_socket_that_cannot_be_opened_is_said_and_run_without(socket_dir: Path) -> None:
    (socket_dir / "file").write_text("")
    path = socket_dir / "file" / "hook.sock"  # under a regular file: no directory can be made
    complaints: list[str] = []
    async with open_hook_channel(
        hook_channel(path, CollectorRegistry()), who="agent", complain=complaints.append
    ) as hooks:
        assert hooks is None
    (complaint,) = complaints
    assert complaint.endswith("; training hooks cannot reach this agent")


async def test_a_control_socket_that_cannot_be_opened_leaves_the_hooks_served(socket_dir: Path) -> None:
    path = socket_dir / "hook.sock"
    control_path(path).write_text("not a socket")  # refused, never removed
    complaints: list[str] = []
    async with open_hook_channel(
        hook_channel(path, CollectorRegistry()), who="watch", complain=complaints.append
    ) as hooks:
        assert hooks is not None
        assert stat.S_ISSOCK(path.lstat().st_mode)
    (complaint,) = complaints
    assert complaint.startswith(f"cannot listen on {control_path(path)}")
    assert complaint.endswith("; `gpuwarden snapshot` cannot reach this watch")
    assert control_path(path).read_text() == "not a socket"
    assert not path.exists()
