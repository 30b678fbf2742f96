"""The loop local mode shares between ``demo`` and ``watch``: snapshots in, findings and rows out.

A :class:`Session` is the operator's evaluation in miniature, without a cluster: each
snapshot (from the scripted backend or NVML) is attributed to subjects
(:mod:`~gpuwarden.local.subjects`), stored in a :class:`~gpuwarden.policy.SeriesStore`, and every
policy is evaluated once its ``evaluationInterval`` has passed, in snapshot time, so a compressed
scenario runs the engine exactly as real time would. What comes back from :meth:`Session.observe`
is a :class:`~gpuwarden.local.rows.Step` (:mod:`~gpuwarden.local.rows`). Scaling is simulated
(:mod:`~gpuwarden.local.scaler`). The run's :class:`History` keeps, for the plot and the summary,
the readings, the findings' spans, the service rules' values at each evaluation and the scale
decisions.

Pure apart from the clock-free bookkeeping: no I/O, no sleeping.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuwarden.local.history import History, ScaleMark
from gpuwarden.local.policies import LocalPolicy
from gpuwarden.local.rows import Announcement, GpuRow, ScaleNote, ShareRow, Step
from gpuwarden.local.scaler import SimulatedScaler, SimulatedTarget
from gpuwarden.local.subjects import (
    ATTRIBUTION,
    PodsOf,
    SubjectKind,
    device_name,
    one_line,
    short_command,
)
from gpuwarden.policy import (
    PROCESS_NAMESPACE,
    Evaluation,
    Finding,
    FindingTransition,
    HealthStore,
    PodId,
    PodView,
    Point,
    PolicyEvaluator,
    SeriesKey,
    SeriesStore,
    ServiceStore,
    Transition,
    process_subject,
    rule_type,
)
from gpuwarden.wire.node import GpuSample, ProcessSample, Snapshot, device_key

POINT_SLACK = 1.25
"""Series room beyond retention / interval: sampling jitters, and a short series would evict early."""


@dataclass(slots=True)
class _Policy:
    policy: LocalPolicy
    evaluator: PolicyEvaluator
    due: float | None = None
    scaler: SimulatedScaler | None = None
    active: tuple[Finding, ...] = ()


class Session:
    """Feeds snapshots through the engine for every policy; keeps the run's :class:`History`.

    ``pods_of`` lists the pods at a snapshot's time with their labels (the demo's
    scenario knows them); without it pods are taken from the snapshot, unlabelled.
    ``sample_interval`` sizes the store.
    """

    def __init__(
        self,
        policies: Sequence[LocalPolicy],
        *,
        subjects: SubjectKind,
        pods_of: PodsOf | None = None,
        sample_interval: float = 1.0,
        history: History | None = None,
    ) -> None:
        if not policies:
            raise ValueError("a session needs at least one policy")
        self.subjects = subjects
        self._attribution = ATTRIBUTION[subjects]
        self._pods_of: PodsOf = pods_of or self._attribution.listed
        self._policies = [
            _Policy(
                policy=p,
                evaluator=PolicyEvaluator(p.key, p.spec, namespace=p.namespace),
                scaler=SimulatedScaler(p) if p.spec.actions.scale is not None else None,
            )
            for p in policies
        ]
        retention = max(p.evaluator.horizon_seconds() for p in self._policies)
        self.store = SeriesStore(
            retention_seconds=retention, max_points=int(retention / sample_interval * POINT_SLACK) + 16
        )
        self.health = HealthStore(retention_seconds=retention)
        self.services = ServiceStore(retention_seconds=retention)
        """The subjects' own metrics (the service rules), for whoever records scrapes into it."""
        self.history = history if history is not None else History()
        self.subject_names: dict[PodId, str] = {}
        """Display name of every subject seen: ``research/notebook-0``, ``pid 4242 python train.py``."""
        self.commands: dict[PodId, str] = {}
        """Each process subject's short command (:func:`short_command`), as its /metrics label has it."""
        self._raw_commands: dict[PodId, str] = {}
        """Each process subject's command line as last read, to name it again only when it changes."""
        self._device_names: dict[str, str] = {}
        self._last_utilization: dict[SeriesKey, float] = {}
        """Each subject's latest utilization reading per device, shown until the next one."""
        self.policies = tuple(policies)

    # -- one snapshot -----------------------------------------------------------------------------

    def observe(self, snapshot: Snapshot) -> Step:
        """Store a snapshot's readings, evaluate the policies that are due, and say what changed."""
        now = snapshot.timestamp
        self.history.mark_time(now)
        subjects_by_device = self._subjects_by_device(snapshot)
        points = list(self._attribution.points(snapshot))
        self.store.extend(points)
        self.health.observe(snapshot, subjects=self._attribution.on_device)
        shares = self._shares(points)
        self._record(snapshot, subjects_by_device, shares)
        devices_of = self._devices_of(snapshot)

        announcements: list[Announcement] = []
        scaling: list[ScaleNote] = []
        evaluated = False
        pods: Sequence[PodView] | None = None
        for entry in self._policies:
            if entry.due is not None and now < entry.due:
                continue
            evaluated = True
            entry.due = now + entry.policy.spec.evaluation_interval_seconds
            if pods is None:
                pods = self._pods_of(snapshot)
                self.store.prune(now)
                self.health.prune(now)
                self.services.prune(now)
            evaluation = entry.evaluator.evaluate(pods, self.store, now, self.health, services=self.services)
            entry.active = evaluation.active
            self._record_judged(evaluation)
            for transition in evaluation.transitions:
                announced = self._track(transition, devices_of)
                if announced is not None:
                    announcements.append(announced)
            note = None if entry.scaler is None else entry.scaler.scale(evaluation, now)
            if note is not None:
                scaling.append(note)
                matched = (devices_of.get(PodId(p.namespace, p.name), ()) for p in evaluation.matched_pods)
                self.history.scaling.append(
                    ScaleMark(
                        now,
                        note.decision.current,
                        note.decision.desired,
                        note.applied,
                        tuple(dict.fromkeys(key for keys in matched for key in keys)),
                    )
                )
        return Step(
            at=now,
            rows=tuple(self._rows(snapshot, subjects_by_device, shares, devices_of)),
            announcements=tuple(announcements),
            scaling=tuple(scaling),
            evaluated=evaluated,
            targets=tuple(t.row for t in self.targets()),
        )

    def active(self) -> list[Finding]:
        """Every policy's active findings after the latest evaluation."""
        return [f for entry in self._policies for f in entry.active]

    def targets(self) -> list[SimulatedTarget]:
        """The simulated scale targets so far, in policy order."""
        return [
            entry.scaler.target
            for entry in self._policies
            if entry.scaler is not None and entry.scaler.target is not None
        ]

    def command(self, namespace: str, pod: str) -> str:
        """A process subject's short command; ``""`` for a pod, or a process that showed none."""
        return self.commands.get(PodId(namespace, pod), "")

    def subject_name(self, namespace: str, pod: str) -> str:
        """A subject's display name (its id if it was never seen on a GPU)."""
        return self.subject_names.get(PodId(namespace, pod)) or (f"{namespace}/{pod}" if namespace else pod)

    # -- internals --------------------------------------------------------------------------------

    def _record_judged(self, evaluation: Evaluation) -> None:
        """The service rules' values, for the plot: no GPU reading shows what they judge."""
        for outcome in evaluation.outcomes:
            if rule_type(outcome.kind).metric is not None:
                subject = self.subject_name(outcome.pod.namespace, outcome.pod.name)
                self.history.record_judged(
                    subject,
                    outcome.rule,
                    outcome.kind,
                    outcome.unit,
                    outcome.threshold,
                    evaluation.at,
                    outcome.value,
                )

    def _subjects_by_device(self, snapshot: Snapshot) -> dict[str, list[str]]:
        """Each device's subjects' display names; learns the names on the way."""
        out: dict[str, list[str]] = {}
        for gpu in snapshot.gpus:
            names: list[str] = []
            if self.subjects is SubjectKind.PROCESSES:
                for proc in gpu.processes:
                    subject = PodId(PROCESS_NAMESPACE, process_subject(proc.pid))
                    if self._raw_commands.get(subject) != proc.command:
                        # First sight, or the PID runs something else now: name it (not every snapshot).
                        self._raw_commands[subject] = proc.command
                        self._name_process(subject, proc)
                    names.append(self.subject_names[subject])
            else:
                refs = [*gpu.pods, *(p.pod for p in gpu.processes if p.pod is not None)]
                for ref in refs:
                    name = f"{ref.namespace}/{ref.name}"
                    self.subject_names[PodId(ref.namespace, ref.name)] = name
                    if name not in names:
                        names.append(name)
            out[device_key(gpu)] = list(dict.fromkeys(names))
        return out

    def _shares(self, points: Sequence[tuple[SeriesKey, Point]]) -> dict[str, list[_Share]]:
        """Each device's subjects with their own readings (utilization as last read), in order."""
        out: dict[str, list[_Share]] = {}
        last = self._last_utilization
        seen: set[SeriesKey] = set()
        for key, point in points:
            seen.add(key)
            if point.gpu_util is not None:
                last[key] = point.gpu_util
            subject = PodId(key.namespace, key.pod)
            name = self.subject_names.get(subject) or self.subject_name(key.namespace, key.pod)
            out.setdefault(key.gpu, []).append(_Share(subject, name, point, last.get(key)))
        for gone in last.keys() - seen:
            del last[gone]
        return out

    def _name_process(self, subject: PodId, proc: ProcessSample) -> None:
        """``pid 474 python3 -c import torch...`` for lines and the table; the whole one for the summary."""
        command = short_command(proc.command)
        name = f"pid {proc.pid}" + (f" {command}" if command else "")
        self.subject_names[subject] = name
        self.commands[subject] = command
        full = one_line(proc.command)
        if full != command:
            self.history.full_names[name] = f"pid {proc.pid} {full}"

    def _record(
        self,
        snapshot: Snapshot,
        subjects_by_device: dict[str, list[str]],
        shares: dict[str, list[_Share]],
    ) -> None:
        for gpu in snapshot.gpus:
            key = device_key(gpu)
            name = device_name(gpu)
            self._device_names[key] = name
            device = self.history.device(key, name, gpu.model)
            for subject in subjects_by_device.get(key, ()):
                device.add_subject(subject)
            mine = shares.get(key, ())
            device.shared = device.shared or len(mine) > 1
            for share in mine:
                point = share.point
                device.share(share.name).append(snapshot.timestamp, point.gpu_util, point.mem_used)
            if gpu.memory_total_bytes is not None:
                device.memory_total = float(gpu.memory_total_bytes)
            device.append(
                snapshot.timestamp,
                gpu.utilization_gpu,
                gpu.sm_active,
                None if gpu.memory_used_bytes is None else float(gpu.memory_used_bytes),
            )

    def _track(
        self, transition: FindingTransition, devices_of: dict[PodId, list[str]]
    ) -> Announcement | None:
        """Keep the history's spans; the transitions worth announcing come back named."""
        finding = transition.finding
        subject = self.subject_name(finding.namespace, finding.pod)
        # The GPUs the value speaks for; failing that (a service rule reads the pod's own metrics),
        # wherever its subject runs, as the table shows it.
        gpus = finding.gpus or tuple(devices_of.get(PodId(finding.namespace, finding.pod), ()))
        devices = tuple(self._device_names.get(g, g) for g in gpus)
        if transition.transition is Transition.STARTED:
            self.history.started(finding, subject, gpus, transition.at)
        elif transition.transition is Transition.RESOLVED:
            self.history.resolved(finding, transition.resolution, transition.at)
        else:
            self.history.updated(finding)
        if transition.transition is Transition.ONGOING:
            return None
        return Announcement(transition, subject, devices)

    def _devices_of(self, snapshot: Snapshot) -> dict[PodId, list[str]]:
        """Each subject's devices in the snapshot (by key): where its processes run, where it is allocated."""
        devices_of: dict[PodId, list[str]] = {}
        for gpu in snapshot.gpus:
            for proc in gpu.processes:
                subject = self._attribution.of_process(proc)
                if subject is not None:
                    devices_of.setdefault(subject, []).append(device_key(gpu))
            for ref in gpu.pods:
                devices_of.setdefault(PodId(ref.namespace, ref.name), []).append(device_key(gpu))
        return {subject: list(dict.fromkeys(keys)) for subject, keys in devices_of.items()}

    def _rows(
        self,
        snapshot: Snapshot,
        subjects_by_device: dict[str, list[str]],
        shares: dict[str, list[_Share]],
        devices_of: dict[PodId, list[str]],
    ) -> Iterator[GpuRow]:
        on_device: dict[str, list[str]] = {}
        on_share: dict[tuple[PodId, str], list[str]] = {}
        for finding in self.active():
            # The GPUs the value speaks for; failing that, wherever its subject runs.
            gpus = finding.gpus or tuple(devices_of.get(PodId(finding.namespace, finding.pod), ()))
            for g in gpus:
                for rules in (
                    on_device.setdefault(g, []),
                    on_share.setdefault((PodId(finding.namespace, finding.pod), g), []),
                ):
                    if finding.rule not in rules:
                        rules.append(finding.rule)
        for gpu in snapshot.gpus:
            key = device_key(gpu)
            mine = shares.get(key, [])
            yield GpuRow(
                device=key,
                name=device_name(gpu),
                model=gpu.model,
                state=gpu.state,
                utilization=gpu.utilization_gpu,
                sm_active=gpu.sm_active,
                memory_used=None if gpu.memory_used_bytes is None else float(gpu.memory_used_bytes),
                memory_total=None if gpu.memory_total_bytes is None else float(gpu.memory_total_bytes),
                subjects=tuple(subjects_by_device.get(key, ())),
                findings=tuple(on_device.get(key, ())),
                allocated=_hooked_sum(gpu, "allocated_bytes"),
                reserved=_hooked_sum(gpu, "reserved_bytes"),
                shares=tuple(
                    ShareRow(
                        subject=share.name,
                        utilization=share.utilization,
                        memory_used=share.point.mem_used,
                        findings=tuple(on_share.get((share.subject, key), ())),
                        allocated=share.point.hook.allocated if share.point.hook else None,
                        reserved=share.point.hook.reserved if share.point.hook else None,
                    )
                    for share in mine
                )
                if len(mine) > 1
                else (),
            )


def _hooked_sum(gpu: GpuSample, reading: Literal["allocated_bytes", "reserved_bytes"]) -> float | None:
    """A hook reading summed over the device's processes that report it; None when none does."""
    values = [getattr(p.hook, reading) for p in gpu.processes if p.hook is not None]
    present = [v for v in values if v is not None]
    return float(sum(present)) if present else None


@dataclass(frozen=True, slots=True)
class _Share:
    """One subject's point on one device at one snapshot, and its utilization as last read."""

    subject: PodId
    name: str
    point: Point
    utilization: float | None
