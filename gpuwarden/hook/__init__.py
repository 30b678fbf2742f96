"""The training-side hook: what only the job can read, sent to the node's gpuwarden agent.

Imports the standard library only (torch when it reads torch's allocator, the integrations their
framework), so a training image needs nothing of the operator's. See docs/hook.md.
"""

from gpuwarden.hook.client import DEFAULT_SOCKET, SOCKET_ENV, HookClient
from gpuwarden.hook.device_memory import MemoryReader, ScriptedMemory, TorchMemory, nvml_uuid
from gpuwarden.hook.host_memory import tree_rss_bytes
from gpuwarden.hook.message import DeviceMemory, Reading, Site, encode_line
from gpuwarden.hook.sites import AllocationTracker
from gpuwarden.hook.step import FRAMES_ENV, TRACEMALLOC_ENV, StepHook

__all__ = [
    "DEFAULT_SOCKET",
    "FRAMES_ENV",
    "SOCKET_ENV",
    "TRACEMALLOC_ENV",
    "AllocationTracker",
    "DeviceMemory",
    "HookClient",
    "MemoryReader",
    "Reading",
    "ScriptedMemory",
    "Site",
    "StepHook",
    "TorchMemory",
    "encode_line",
    "nvml_uuid",
    "tree_rss_bytes",
]
