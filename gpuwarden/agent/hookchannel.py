"""The training hooks' channel, set up the same way by the agent and by ``gpuwarden watch``.

:func:`hook_channel` builds the parts: the hook socket's server (:class:`HookServer`), the readings
it fills, their metrics, and the sampler's hook stage that attaches the readings to each snapshot.
:func:`open_hook_channel` listens on the hook socket and, beside it, on the ``.control`` socket that
``gpuwarden snapshot`` asks through (:class:`ControlServer`), for the length of a ``with`` block.
A socket that cannot be opened is said (``complain``) and run without: the GPUs' readings matter more
than the hooks'.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from gpuwarden.agent.hookattach import HookStage
from gpuwarden.agent.hookcontrol import ControlServer
from gpuwarden.agent.hookrelay import PodProcesses
from gpuwarden.agent.hooksocket import HookReadings, HookServer, HookSocketError
from gpuwarden.agent.metrics import HookMetrics


@dataclass(frozen=True, slots=True)
class HookChannel:
    server: HookServer
    stage: HookStage
    processes: PodProcesses
    """The pods' hooked processes as the newest snapshot has them (the agent's sampler keeps it)."""


def hook_channel(path: Path, registry: CollectorRegistry) -> HookChannel:
    """The hook socket's server at ``path`` and the sampler's hook stage, counted in ``registry``."""
    readings = HookReadings()
    metrics = HookMetrics(registry, readings, time.time)
    return HookChannel(
        HookServer(path, readings, events=metrics), HookStage(readings, metrics), PodProcesses()
    )


@contextlib.asynccontextmanager
async def open_hook_channel(
    channel: HookChannel, *, who: str, complain: Callable[[str], None], control: bool = True
) -> AsyncIterator[HookServer | None]:
    """The hook server listening (None if it cannot: ``complain`` says why), with the control socket
    unless ``control`` is false; both closed on the way out. ``who`` names the process in the complaints
    ("agent", "watch")."""
    hooks = channel.server
    try:
        await hooks.start()
    except HookSocketError as exc:
        complain(f"{exc}; training hooks cannot reach this {who}")
        yield None
        return
    try:
        async with contextlib.AsyncExitStack() as stack:
            if control:
                answering = ControlServer(hooks, channel.processes)
                try:
                    await answering.start()
                except OSError as exc:
                    why = f"cannot listen on {answering.path} ({exc})"
                    complain(f"{why}; `gpuwarden snapshot` cannot reach this {who}")
                else:
                    stack.push_async_callback(answering.close)
            yield hooks
    finally:
        await hooks.close()
