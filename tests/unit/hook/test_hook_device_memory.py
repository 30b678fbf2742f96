"""Device UUIDs as NVML spells them, and the scripted reader."""

from __future__ import annotations

from gpuwarden.hook import DeviceMemory, ScriptedMemory, nvml_uuid

RAW = "5f1c2d3e-4a5b-6c7d-8e9f-0a1b2c3d4e5f"


def test_torch_uuids_get_nvml_prefixes() -> None:
    # As read on the H200: torch's str(get_device_properties(0).uuid), then nvidia-smi's uuid.
    assert nvml_uuid("0870f3d2-3202-f058-8615-020988542741", "NVIDIA H200") == (
        "GPU-0870f3d2-3202-f058-8615-020988542741"
    )
    assert nvml_uuid(RAW, "NVIDIA H200") == f"GPU-{RAW}"
    assert nvml_uuid(RAW, "NVIDIA H100 80GB HBM3 MIG 1g.10gb") == f"MIG-{RAW}"
    assert nvml_uuid(f"GPU-{RAW}", "NVIDIA H200") == f"GPU-{RAW}"
    assert nvml_uuid(f" MIG-{RAW}\n", "NVIDIA A100-SXM4-40GB MIG 3g.20gb") == f"MIG-{RAW}"
    assert nvml_uuid(RAW, "NVIDIA MIGHTY") == f"GPU-{RAW}"  # "MIG" as a word only


def test_scripted_memory_plays_then_holds_the_last() -> None:
    a, b = [DeviceMemory("GPU-a", 1)], [DeviceMemory("GPU-a", 2)]
    memory = ScriptedMemory([a, b])
    assert [memory.read() for _ in range(4)] == [a, b, b, b]
    assert ScriptedMemory([]).read() == ()
