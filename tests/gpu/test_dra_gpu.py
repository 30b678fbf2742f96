"""NVIDIA's DRA device names through NVML's minor numbers, on a real GPU (never in CI).

NVIDIA's DRA driver names a GPU ``gpu-<minor>``, the minor number of its ``/dev/nvidia<minor>``.
The agent resolves such a name without the API server through ``nvmlDeviceGetMinorNumber``; the
driver's own ``/proc/driver/nvidia/gpus/<bus id>/information`` (``Device Minor``, ``GPU UUID``)
is the independent account that NVML's must match, and the name must resolve to the UUID the NVML
backend samples under.

    pytest -m gpu tests/gpu/test_dra_gpu.py -s -o addopts=''
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from gpuwarden.agent.attribution import Allocations, DraDevice, DraResolver, nvml_minor_numbers
from gpuwarden.agent.nvml import NvmlBackend
from gpuwarden.wire.node import PodRef

pytestmark = pytest.mark.gpu


def driver_minor_numbers() -> dict[int, str]:
    """Minor number → UUID, as the kernel driver tells it under /proc."""
    found: dict[int, str] = {}
    for info in Path("/proc/driver/nvidia/gpus").glob("*/information"):
        text = info.read_text()
        minor = re.search(r"^Device Minor:\s*(\d+)", text, re.M)
        uuid = re.search(r"^GPU UUID:\s*(\S+)", text, re.M)
        assert minor, text
        assert uuid, text
        found[int(minor.group(1))] = uuid.group(1)
    return found


def test_gpu_minor_names_resolve_to_the_uuids_the_backend_samples() -> None:
    backend = NvmlBackend()
    backend.open()  # initialises NVML, which nvml_minor_numbers expects, as in the agent
    try:
        minors = nvml_minor_numbers()
        sampled = {gpu.uuid for gpu in backend.sample_devices(time.time())}
        holder = PodRef(namespace="ml", name="p", container="c", claim="gpu")
        claimed = Allocations(
            claimed={DraDevice("gpu.nvidia.com", "node", f"gpu-{m}"): (holder,) for m in minors}
        )
        # resolved while NVML is open, as the agent does between its backend's open and close
        resolver = DraResolver(None, minor_numbers=nvml_minor_numbers)
        resolved = resolver.resolve(claimed).devices
    finally:
        backend.close()
    print(f"\nNVML minor numbers: {minors}")
    expected = driver_minor_numbers()
    if expected:  # a container may not show /proc/driver/nvidia
        assert minors == expected
    assert set(minors.values()) == sampled
    assert resolved == {uuid: (holder,) for uuid in minors.values()}
    assert resolver.unresolved == {}
