"""Scripted scenarios: the file format, the pieces, determinism, and the packaged demo files."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.agent.backend import DeviceBackend
from gpuwarden.agent.scripted import ScenarioAttributor, ScriptedBackend
from gpuwarden.sim.scenario import PACKAGED, ScenarioError, load_scenario, packaged_scenario, parse_scenario
from gpuwarden.wire.node import DeviceState, PodRef, Snapshot

MI = 2**20
GI = 2**30
UUID = "GPU-00000000-0000-4000-8000-000000000000"


def one_gpu(**gpu: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "uuid": UUID,
        "memoryTotal": "80Gi",
        "utilization": [{"kind": "idle", "level": 10}],
        "memory": [{"kind": "idle", "level": "1Gi"}],
    }
    spec.update(gpu)
    return {"name": "t", "duration": "10m", "seed": 1, "gpus": [spec]}


def memory_at(scenario_spec: dict[str, Any], t: float) -> int:
    (sample,) = parse_scenario(scenario_spec).gpu_samples(t)
    assert sample.memory_used_bytes is not None
    return sample.memory_used_bytes


def util_at(scenario_spec: dict[str, Any], t: float) -> float:
    (sample,) = parse_scenario(scenario_spec).gpu_samples(t)
    assert sample.utilization_gpu is not None
    return sample.utilization_gpu


# -- pieces -------------------------------------------------------------------------------------


def test_idle_is_a_level_with_bounded_noise_and_periodic_spikes() -> None:
    spec = one_gpu(
        utilization=[
            {"kind": "idle", "level": 3, "noise": 1, "spikeEvery": "5m", "spikeFor": "10s", "spikeLevel": 40}
        ]
    )
    scenario = parse_scenario(spec)
    values = [scenario.gpu_samples(t)[0].utilization_gpu or 0.0 for t in range(0, 600)]
    spikes = [t for t, v in enumerate(values) if v > 30]
    assert spikes == [*range(290, 300), *range(590, 600)]
    quiet = [v for t, v in enumerate(values) if t not in spikes]
    assert all(0 <= v <= 6 for v in quiet)  # three sigma at most
    assert statistics.mean(quiet) == pytest.approx(3, abs=0.2)
    assert statistics.stdev(quiet) == pytest.approx(1, abs=0.2)


def test_leak_grows_at_its_rate_from_where_the_previous_piece_ended_and_stops_at_max() -> None:
    spec = one_gpu(
        memory=[
            {"kind": "idle", "level": "2Gi"},
            {"kind": "leak", "at": "1m", "rate": "200Mi/m", "max": "3Gi"},
        ]
    )
    assert memory_at(spec, 30) == 2 * GI
    assert memory_at(spec, 60) == 2 * GI
    assert memory_at(spec, 60 + 120) == 2 * GI + 400 * MI
    assert memory_at(spec, 3600) == 3 * GI


def test_leak_rate_as_a_plain_number_is_per_minute() -> None:
    spec = one_gpu(memory=[{"kind": "leak", "start": 0, "rate": 60 * MI}])
    assert memory_at(spec, 10) == 10 * MI


def test_staircase_steps_then_plateaus() -> None:
    spec = one_gpu(memory=[{"kind": "staircase", "start": "4Gi", "step": "16Gi", "every": "90s", "steps": 4}])
    steps = [memory_at(spec, t) // GI for t in (0, 89, 90, 180, 270, 271, 3000)]
    assert steps == [20, 20, 36, 52, 68, 68, 68]


def test_sawtooth_ramps_and_drops_back() -> None:
    spec = one_gpu(utilization=[{"kind": "sawtooth", "low": 20, "high": 80, "period": "60s"}])
    assert [util_at(spec, t) for t in (0, 30, 59, 60, 90)] == [20, 50, 79, 20, 50]


def test_saturated_defaults_to_98() -> None:
    spec = one_gpu(utilization=[{"kind": "saturated", "noise": 0}])
    assert util_at(spec, 100) == 98


def test_values_are_clamped_to_what_a_device_can_read() -> None:
    spec = one_gpu(
        utilization=[{"kind": "saturated", "level": 100, "noise": 5}],
        memory=[{"kind": "leak", "start": "79Gi", "rate": "10Gi/m"}],
    )
    scenario = parse_scenario(spec)
    for t in range(0, 300, 7):
        (sample,) = scenario.gpu_samples(t)
        assert sample.utilization_gpu is not None
        assert sample.utilization_gpu <= 100
        assert sample.memory_used_bytes is not None
        assert sample.memory_used_bytes <= 80 * GI


def test_lost_then_recover() -> None:
    spec = one_gpu(health=[{"kind": "lost", "at": "2m"}, {"kind": "recover", "at": "3m"}])
    scenario = parse_scenario(spec)
    states = {t: scenario.gpu_samples(t)[0] for t in (119, 120, 179, 180)}
    assert states[119].state is DeviceState.OK
    lost = states[120]
    assert lost.state is DeviceState.LOST
    assert (lost.utilization_gpu, lost.memory_used_bytes, lost.sm_active, lost.power_watts) == (None,) * 4
    assert states[179].state is DeviceState.LOST
    assert states[180].state is DeviceState.OK
    assert scenario.process_utilization(150) == {}


def test_no_gpm_means_no_sm_active() -> None:
    (sample,) = parse_scenario(one_gpu(gpm=False)).gpu_samples(5)
    assert sample.utilization_gpu == 10
    assert (sample.sm_active, sample.sm_occupancy, sample.tensor_active, sample.dram_active) == (None,) * 4


# -- determinism --------------------------------------------------------------------------------


def test_the_same_time_gives_the_same_reading_in_any_order() -> None:
    forwards = load_scenario("demo")
    backwards = load_scenario("demo")
    times = [0, 1, 2.5, 61, 599, 1799]
    ahead = [forwards.snapshot(t) for t in times]
    behind = [backwards.snapshot(t) for t in reversed(times)][::-1]
    assert ahead == behind


def test_a_different_seed_gives_different_noise() -> None:
    spec = one_gpu(utilization=[{"kind": "idle", "level": 50, "noise": 5}])
    other = {**spec, "seed": 2}
    assert [util_at(spec, t) for t in range(5)] != [util_at(other, t) for t in range(5)]


# -- pods, processes, attribution ---------------------------------------------------------------


def two_pods() -> dict[str, Any]:
    spec = one_gpu(
        utilization=[{"kind": "idle", "level": 60}],
        memory=[{"kind": "idle", "level": "10Gi"}],
        reservedMemory="1Gi",
    )
    spec["pods"] = [
        {
            "namespace": "ml",
            "name": "a",
            "container": "main",
            "labels": {"app": "a"},
            "gpus": [UUID],
            "processes": [{"pid": 10, "command": "python a.py", "share": 2}],
            "hostMemory": [{"kind": "idle", "level": "2Gi"}],
        },
        {
            "namespace": "ml",
            "name": "b",
            "gpus": [UUID],
            "processes": [{"pid": 20}],
            "until": "1m",
        },
    ]
    return spec


def test_processes_share_memory_above_the_reserved_part_and_utilization() -> None:
    scenario = parse_scenario(two_pods())
    (sample,) = scenario.gpu_samples(30)
    assert {p.pid: p.used_memory_bytes for p in sample.processes} == {10: 6 * GI, 20: 3 * GI}
    assert sample.pods == []  # the backend reads devices; pods are the attributor's
    assert scenario.process_utilization(30) == {UUID: {10: 40.0, 20: 20.0}}


def test_a_process_that_runs_no_kernel_is_left_out_of_the_per_process_reading() -> None:
    spec = two_pods()
    spec["pods"][1]["processes"] = [{"pid": 20, "kernels": False}]
    scenario = parse_scenario(spec)
    # It holds its memory; the GPU's utilization is all the busy one's, and NVML does not list it.
    (sample,) = scenario.gpu_samples(30)
    assert {p.pid: p.used_memory_bytes for p in sample.processes} == {10: 6 * GI, 20: 3 * GI}
    assert scenario.process_utilization(30) == {UUID: {10: 60.0}}
    # The snapshot (what the demo plays) reads it as the agent does: 0%, not unknown.
    (gpu,) = scenario.snapshot(30).gpus
    assert {p.pid: p.sm_util for p in gpu.processes} == {10: 60.0, 20: 0.0}


def test_a_gpu_without_per_process_readings_leaves_its_processes_unknown() -> None:
    spec = two_pods()
    spec["gpus"][0]["processUtilization"] = False
    scenario = parse_scenario(spec)
    assert scenario.process_utilization(30) == {}
    (gpu,) = scenario.snapshot(30).gpus
    assert {p.pid: p.sm_util for p in gpu.processes} == {10: None, 20: None}


def test_scenario_attributor_names_pods_processes_and_host_memory_and_pods_leave() -> None:
    backend = ScriptedBackend(parse_scenario(two_pods()), origin=1_000_000.0)
    backend.open()
    attributor = ScenarioAttributor(backend)

    def at(t: float) -> Snapshot:
        now = 1_000_000.0 + t
        return attributor.annotate(Snapshot(timestamp=now, gpus=backend.sample_devices(now)))

    early = at(30)
    (gpu,) = early.gpus
    assert gpu.pods == [PodRef(namespace="ml", name="a", container="main"), PodRef(namespace="ml", name="b")]
    assert {p.pid: p.pod and p.pod.name for p in gpu.processes} == {10: "a", 20: "b"}
    assert [(m.name, m.memory_bytes) for m in early.pod_host_memory] == [("a", 2 * GI)]

    late = at(90)
    (gpu,) = late.gpus
    assert [p.name for p in gpu.pods] == ["a"]
    assert [(p.pid, p.used_memory_bytes) for p in gpu.processes] == [(10, 9 * GI)]


def test_a_gpu_in_mig_mode_lists_its_mig_devices_and_their_pods_and_a_claim_names_its_pods() -> None:
    mig = "MIG-00000000-0000-4000-8000-000000000001"
    spec = one_gpu(mig=[{"uuid": mig, "memoryTotal": "20Gi", "smActive": [{"kind": "idle", "level": 70}]}])
    spec["pods"] = [
        {"namespace": "ml", "name": "small", "gpus": [mig], "processes": [{"pid": 7}]},
        {"namespace": "ml", "name": "shared", "gpus": [UUID], "claim": "whole-gpu"},
    ]
    scenario = parse_scenario(spec)
    gpu, slice_ = scenario.snapshot(30).gpus
    assert (gpu.mig_id, [p.claim for p in gpu.pods]) == (None, ["whole-gpu"])
    assert (slice_.uuid, slice_.mig_id, slice_.memory_total_bytes) == (UUID, mig, 20 * GI)
    assert (slice_.utilization_gpu, slice_.sm_active) == (None, 70.0)  # GPM's, no utilization on MIG
    assert [p.name for p in slice_.pods] == ["small"]
    assert [(p.pid, p.sm_util) for p in slice_.processes] == [(7, None)]  # no per-process reading
    assert [p.pid for p in gpu.processes] == []
    spec["gpus"][0]["mig"].append({**spec["gpus"][0]["mig"][0], "uuid": "MIG-2", "memoryTotal": "70Gi"})
    with pytest.raises(ScenarioError, match="more than the GPU's"):
        parse_scenario(spec)


async def test_scenario_attributor_refresh_is_a_no_op() -> None:
    backend = ScriptedBackend(parse_scenario(two_pods()), origin=1_000_000.0)
    backend.open()
    attributor = ScenarioAttributor(backend)
    snapshot = Snapshot(timestamp=1_000_030.0, gpus=backend.sample_devices(1_000_030.0))
    before = attributor.annotate(snapshot)
    assert [p.name for p in before.gpus[0].pods] == ["a", "b"]  # named without any refresh
    await attributor.refresh()  # nothing to fetch (no kubelet): it neither fails nor changes anything
    assert attributor.annotate(snapshot) == before


def test_scripted_backend_is_a_device_backend_playing_from_its_origin() -> None:
    clock = iter([5000.0]).__next__
    backend: DeviceBackend = ScriptedBackend(parse_scenario(two_pods()), clock=clock)
    backend.open()
    assert backend.name == "scripted"
    assert backend.sample_devices(5030.0) == parse_scenario(two_pods()).gpu_samples(30)
    assert backend.sample_process_utilization(5030.0) == {UUID: {10: 40.0, 20: 20.0}}
    backend.close()


# -- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda s: s["gpus"][0].update(memoryTotal="lots"), r"gpus\.0\.memoryTotal"),
        (lambda s: s["gpus"][0]["memory"].append({"kind": "drizzle"}), r"gpus\.0\.memory\.1"),
        (lambda s: s["gpus"][0]["memory"][0].update(at="5m"), "must start at 0"),
        (lambda s: s["gpus"].append(dict(s["gpus"][0])), "share a uuid"),
        (lambda s: s["pods"][0].update(gpus=["GPU-nope"]), "not a GPU here"),
        (lambda s: s["pods"][0].update(claim="Not_A_Name"), r"pods\.0\.claim"),
        (lambda s: s["pods"][1]["processes"][0].update(pid=10), "pid 10 appears twice"),
        (lambda s: s.update(duration="forever"), "duration"),
        (lambda s: s["gpus"][0].update(colour="green"), "colour"),
    ],
)
def test_invalid_scenarios_name_the_field(mutate: Any, message: str) -> None:
    spec = two_pods()
    mutate(spec)
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(spec)


def test_unreadable_files_are_scenario_errors(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="cannot read"):
        load_scenario(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("gpus: [")
    with pytest.raises(ScenarioError, match="not valid YAML"):
        load_scenario(bad)


# -- the packaged scenarios ---------------------------------------------------------------------


@pytest.mark.parametrize("name", PACKAGED)
def test_packaged_scenarios_load_by_name_and_by_path(name: str) -> None:
    by_name = load_scenario(name)
    by_path = load_scenario(packaged_scenario(name))
    assert by_name.snapshot(42) == by_path.snapshot(42)
    assert len(by_name.snapshot(0).gpus) == len(by_name.spec.gpus) >= 2


def pod_gpu(snapshot: Snapshot, pod: str) -> Any:
    (gpu,) = [g for g in snapshot.gpus if any(p.name == pod for p in g.pods)]
    return gpu


def slope_mib_per_min(scenario: Any, pod: str, t0: float, t1: float) -> float:
    used0 = pod_gpu(scenario.snapshot(t0), pod).memory_used_bytes
    used1 = pod_gpu(scenario.snapshot(t1), pod).memory_used_bytes
    return float((used1 - used0) / MI / ((t1 - t0) / 60))


def test_demo_tells_its_four_stories() -> None:
    demo = load_scenario("demo")
    assert demo.duration == 30 * 60
    snapshots = [demo.snapshot(t) for t in range(0, 1800, 10)]
    assert all(len(s.gpus) == 8 for s in snapshots)
    assert all(g.state is DeviceState.OK for s in snapshots for g in s.gpus)
    # Played alone (no one scales it), the Deployment keeps its two replicas on GPUs 3 and 4.
    assert all([len(g.pods) for g in s.gpus] == [1, 1, 1, 1, 1, 0, 0, 0] for s in snapshots)

    def series(pod: str, field: str) -> list[float]:
        return [getattr(pod_gpu(s, pod), field) for s in snapshots]

    # an idle pod: ~3% for 22 minutes, then real work (~72% busy, SM activity ~61%) to the end
    work = 22 * 60 // 10  # index of the first snapshot at 22m
    idle_util = series("notebook-idle-0", "utilization_gpu")
    idle_sm = series("notebook-idle-0", "sm_active")
    assert statistics.mean(idle_util[:work]) == pytest.approx(3, abs=1)
    assert max(idle_util[work - 1], idle_sm[work - 1]) < 10  # idle to the last sample before 22m
    assert statistics.mean(idle_util[work:]) == pytest.approx(72, abs=3)
    assert 55 <= statistics.mean(idle_sm[work:]) <= 70
    assert min(idle_util[work:]) > 50  # busy from its first sample on, not ramping up
    # a leak: ~200Mi/m, steady, below the card's size at the end
    assert slope_mib_per_min(demo, "llm-finetune-0", 120, 1790) == pytest.approx(200, rel=0.02)
    leak_gpu = pod_gpu(demo.snapshot(1799), "llm-finetune-0")
    assert 0.9 < leak_gpu.memory_used_bytes / leak_gpu.memory_total_bytes < 0.99
    # a caching allocator: steps early, then flat for the rest of the run
    cache = series("vision-train-0", "memory_used_bytes")
    assert cache[0] < cache[30]
    assert max(cache[30:]) - min(cache[30:]) < 64 * MI
    # a server of two replicas sharing a load: ~75% each, until the ramp (12m-20m) saturates both
    servers = [p.ref.name for p in demo.pods_at(0) if p.labels.get("app") == "llm-server"]
    assert len(servers) == 2
    for server in servers:
        busy = series(server, "utilization_gpu")
        assert statistics.mean(busy[: 12 * 6]) == pytest.approx(75, abs=2)
        assert min(busy[18 * 6 :]) == 100.0


def test_e2e_fast_has_the_demos_cases_within_seconds() -> None:
    fast = load_scenario("e2e-fast")
    demo = load_scenario("demo")
    assert [g.uuid for g in fast.snapshot(0).gpus] == [g.uuid for g in demo.snapshot(0).gpus][:4]
    assert [p.ref for p in fast.pods][:3] == [p.ref for p in demo.pods]
    assert slope_mib_per_min(fast, "llm-finetune-0", 0, 60) == pytest.approx(3 * 1024, rel=0.02)
    cache = [pod_gpu(fast.snapshot(t), "vision-train-0").memory_used_bytes for t in range(0, 60)]
    assert cache[0] < cache[10]
    assert max(cache[10:]) - min(cache[10:]) < 64 * MI


# -- Deployments: replicas that share a load --------------------------------------------------------


def serving(**deployment: Any) -> dict[str, Any]:
    """Three spare GPUs and a Deployment of one replica on them, 150% of a replica's load."""
    gpus = [
        {
            "uuid": f"GPU-{i}",
            "memoryTotal": "80Gi",
            "utilization": [{"kind": "idle", "level": 0}],
            "memory": [{"kind": "idle", "level": 0}],
        }
        for i in range(3)
    ]
    spec: dict[str, Any] = {
        "namespace": "inference",
        "name": "llm",
        "labels": {"app": "llm"},
        "gpus": [g["uuid"] for g in gpus],
        "startup": "60s",
        "memory": "40Gi",
        "pid": 100,
        "load": [{"kind": "idle", "level": 150}],
    }
    spec.update(deployment)
    return {"name": "t", "duration": "10m", "gpus": gpus, "deployments": [spec]}


def utilization(scenario: Any, t: float) -> list[float]:
    return [g.utilization_gpu for g in scenario.snapshot(t).gpus]


def test_a_deployment_splits_its_load_over_the_replicas_that_serve() -> None:
    scenario = parse_scenario(serving())
    assert utilization(scenario, 10) == [100.0, 0.0, 0.0]  # one replica cannot carry 150%
    assert scenario.scale("inference", "llm", 2, 100)
    # The new replica loads its model for a minute: memory rising in 8 shards, no load taken yet.
    loading = scenario.snapshot(130).gpus[1]
    assert loading.utilization_gpu == pytest.approx(2.0)
    assert loading.memory_used_bytes == 5 / 8 * 40 * GI  # 30 s in: the fifth shard of 5Gi
    assert scenario.snapshot(100).gpus[1].memory_used_bytes == 5 * GI  # the first, as it appears
    assert utilization(scenario, 130)[0] == 100.0
    # Serving: the load splits; the first replica is no longer saturated.
    assert utilization(scenario, 160) == [75.0, 75.0, 0.0]
    pods = scenario.pods_at(160)
    assert [p.gpus for p in pods] == [("GPU-0",), ("GPU-1",)]
    assert len({p.ref.name for p in pods}) == 2
    assert all(p.ref.name.startswith("llm-") and p.labels["app"] == "llm" for p in pods)
    assert [proc.pid for p in pods for proc in p.processes] == [100, 101]
    # Back to one: the newest replica goes, its GPU is idle again and the load is one pod's.
    scenario.scale("inference", "llm", 1, 300)
    assert utilization(scenario, 310) == [100.0, 0.0, 0.0]
    assert [p.ref.name for p in scenario.pods_at(310)] == [pods[0].ref.name]


def test_a_deployment_keeps_its_pod_names_and_is_deterministic() -> None:
    a, b = parse_scenario(serving(replicas=2)), parse_scenario(serving(replicas=2))
    assert [p.ref for p in a.pods_at(0)] == [p.ref for p in b.pods_at(0)]
    assert a.snapshot(42) == b.snapshot(42)
    # The replicas the file starts with serve from t = 0.
    assert utilization(a, 0) == [75.0, 75.0, 0.0]


def test_replicas_beyond_the_gpus_stay_unscheduled_and_unknown_deployments_are_refused() -> None:
    scenario = parse_scenario(serving())
    scenario.scale("inference", "llm", 5, 0)
    assert len(scenario.pods_at(100)) == 3
    assert utilization(scenario, 100) == [50.0, 50.0, 50.0]
    assert not scenario.scale("inference", "other", 2, 0)


def test_ramp_goes_from_the_previous_level_to_its_target() -> None:
    spec = serving(
        load=[{"kind": "idle", "level": 100}, {"kind": "ramp", "at": "1m", "to": 200, "over": "2m"}]
    )
    scenario = parse_scenario(spec)
    scenario.scale("inference", "llm", 3, 0)
    assert [round(sum(utilization(scenario, t))) for t in (60, 120, 180, 300)] == [100, 150, 200, 200]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"gpus": ["GPU-9"]}, "places replicas on GPU-9, not a GPU here"),
        ({"replicas": 4}, "4 replicas need as many gpus"),
        ({"load": [{"kind": "idle", "at": "1m", "level": 1}]}, "pieces must start at 0"),
    ],
)
def test_deployment_errors_name_the_deployment(change: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(serving(**change))


def test_a_deployment_gpu_cannot_also_be_a_pods() -> None:
    spec = serving()
    spec["pods"] = [{"namespace": "a", "name": "b", "gpus": ["GPU-0"]}]
    with pytest.raises(ScenarioError, match="GPU-0 is already allocated"):
        parse_scenario(spec)
    spec = serving()
    spec["pods"] = [{"namespace": "a", "name": "b", "gpus": [], "processes": []}]
    spec["gpus"].append({**spec["gpus"][0], "uuid": "GPU-x"})
    spec["pods"] = [{"namespace": "a", "name": "b", "gpus": ["GPU-x"], "processes": [{"pid": 101}]}]
    with pytest.raises(ScenarioError, match="overlap"):
        parse_scenario(spec)
