"""NVIDIA's DRA device names through NVML's minor numbers, on a real GPU (never in CI).

NVIDIA's DRA driver names a GPU ``gpu-<minor>``, the minor number of its ``/dev/nvidia<minor>``.
The agent resolves such a name without the API server through ``nvmlDeviceGetMinorNumber``; the
driver's own ``/proc/driver/nvidia/gpus/<bus id>/information`` (``Device Minor``, ``GPU UUID``)
is the independent account that NVML's must match, and the name must resolve to the UUID the NVML
backend samples under.

    pytest -m gpu tests/gpu/test_dra_gpu.py -s -o addopts=''
"""

from __future__ import annotations

import ctypes
import re
import time
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.agent.attribution import (
    Allocations,
    DraDevice,
    DraResolver,
    MigPlacement,
    UnresolvedReason,
    mig_placement,
)
from gpuwarden.agent.nvml import NvmlBackend, nvml_mig_devices, nvml_minor_numbers
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


def driver_profile_name(profile: str) -> str:
    """A MIG profile as NVIDIA's DRA driver puts it in a device name: lower case, dots dropped."""
    return re.sub(r"[^a-z0-9-]", "-", profile.lower().replace(".", "")).strip("-")


def possible_placements(handle: Any, profile_id: int) -> list[Any]:
    """``nvmlDeviceGetGpuInstancePossiblePlacements``: asked for the count, then for the placements."""
    import pynvml

    count = ctypes.c_uint(0)
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    placements = (pynvml.c_nvmlGpuInstancePlacement_t * count.value)()
    pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, placements, ctypes.byref(count))
    return list(placements[: count.value])


def test_dynamic_mig_names_against_nvml_profiles_and_placements() -> None:
    import pynvml

    backend = NvmlBackend()
    backend.open()
    try:
        minors = nvml_minor_numbers()
        names: list[tuple[str, MigPlacement]] = []
        modes: dict[int, int] = {}
        for minor, uuid in minors.items():
            handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            modes[minor] = pynvml.nvmlDeviceGetMigMode(handle)[0]
            for profile in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                try:
                    info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, profile)
                    placements = possible_placements(handle, info.id)
                except pynvml.NVMLError as e:
                    print(f"GPU {minor}: profile {profile}: {e}")
                    continue
                slices = f"{info.sliceCount}g{info.memorySizeMB // 1024}gb"
                for placement in placements:
                    name = f"gpu-{minor}-mig-{driver_profile_name(slices)}-{info.id}-{placement.start}"
                    names.append((name, MigPlacement(minor, int(info.id), int(placement.start))))
        found = nvml_mig_devices({placement for _, placement in names})
        holder = PodRef(namespace="ml", name="p", container="c", claim="mig")
        claimed = Allocations(claimed={DraDevice("gpu.nvidia.com", "node", n): (holder,) for n, _ in names})
        resolver = DraResolver(None, minor_numbers=nvml_minor_numbers, mig_devices=nvml_mig_devices)
        resolver.resolve(claimed)
    finally:
        backend.close()
    print(f"\nMIG modes: {modes}; {len(names)} possible placements, e.g. {names[:3]}")
    for name, placement in names:
        assert mig_placement(name) == placement, name
    if all(mode == pynvml.NVML_DEVICE_MIG_DISABLE for mode in modes.values()):
        # MIG off: no MIG device exists, and every dynamic name is said to be missing, none raised
        assert found == {}
        assert set(resolver.unresolved.values()) == {UnresolvedReason.MIG_NOT_FOUND}
    else:
        assert all(uuid.startswith("MIG-") for uuid in found.values())
