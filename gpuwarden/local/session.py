"""The loop local mode shares between ``demo`` and ``watch``: snapshots in, findings and rows out.

A :class:`Session` is the operator's evaluation in miniature, without a cluster: each
snapshot (from the scripted backend or NVML) is attributed to subjects, stored in a
:class:`~gpuwarden.policy.SeriesStore`, and every policy is evaluated once its
``evaluationInterval`` has passed, in snapshot time, so a compressed scenario runs the
engine exactly as real time would. What comes back from :meth:`Session.observe` is a
:class:`Step`: the GPUs as the display shows them (on a GPU several subjects share, each
subject's own readings, as the engine judges them: :class:`ShareRow`), the findings that
started, re-notified or cleared, and the scale decisions. The run's :class:`History` keeps, for the
plot and the summary, the readings, the findings' spans, the service rules' values at each
evaluation and the scale decisions.

Subjects are pods (``demo``: the scenario's pods, with their labels) or host processes
(``watch``: ``pid/<pid>`` in namespace ``""``, see :func:`gpuwarden.policy.process_subject`).
A process is shown as ``pid 474 python3 -c import torch...``: its executable's basename and
arguments, cut at :data:`COMMAND_WIDTH` (a ``python -c`` script would make every line hundreds
of characters long); the whole command line is kept for the summary.

Scaling is decided as the operator decides it: a :class:`SimulatedScaler` takes the same
pure :func:`~gpuwarden.policy.scaling.decider.scale_step` after each evaluation with the target's
current replicas, applies a change the step asks for and settles the step, which starts
its cooldown. There is no cluster, so the target is a :class:`SimulatedTarget`: it starts
with one replica per pod the policy matches (when it first matches any) and follows the
decisions, 1 -> 2 -> 3 within ``minReplicas``/``maxReplicas``. Whoever plays the snapshots
makes the replicas real: the demo scales the scenario's Deployment of that name
(:meth:`gpuwarden.sim.scenario.Scenario.scale`), whose load then spreads over the new
pods once they start, so scaling out lowers each pod's utilization and stops when it is
low enough. A target with no such Deployment gets no pods: a saturated server then keeps
asking, once per cooldown, up to ``maxReplicas``. A ``dryRun: true`` policy leaves the
replicas as they are, as the operator would, and its wish comes back once per cooldown
unchanged. A policy with ``forecast`` is asked with each evaluation's load sample, as
the operator asks it.

Pure apart from the clock-free bookkeeping: no I/O, no sleeping.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

from gpuwarden.local.history import History, ScaleMark
from gpuwarden.local.policies import LocalPolicy
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
    ScaleDecider,
    ScaleDecision,
    SeriesKey,
    SeriesStore,
    ServiceStore,
    StepKind,
    Transition,
    pods_of,
    points_from_processes,
    points_from_snapshot,
    process_subject,
    rule_type,
    scale_step,
)
from gpuwarden.wire.node import DeviceState, GpuSample, ProcessSample, Snapshot, device_key

POINT_SLACK = 1.25
"""Series room beyond retention / interval: sampling jitters, and a short series would evict early."""
COMMAND_WIDTH = 60
"""Characters of a process's command in its display name and its /metrics label, ``...`` included."""
ELLIPSIS = "..."
"""ASCII, as the rest of local mode's output (display.py): a log stays legible in any encoding."""


class SubjectKind(enum.StrEnum):
    """What a finding is about in local mode."""

    PODS = "pod"
    PROCESSES = "process"


PodsOf = Callable[[Snapshot], Sequence[PodView]]
"""The pods that exist at a snapshot's time, with their labels (what a pod list would say)."""


def pods_in(snapshot: Snapshot) -> list[PodView]:
    """The pods a snapshot names (allocated a GPU or running on one), without labels."""
    seen: dict[PodId, None] = {}
    for gpu in snapshot.gpus:
        for ref in gpu.pods:
            seen.setdefault(PodId(ref.namespace, ref.name), None)
        for proc in gpu.processes:
            if proc.pod is not None:
                seen.setdefault(PodId(proc.pod.namespace, proc.pod.name), None)
    return [PodView(namespace=p.namespace, name=p.name) for p in seen]


def processes_in(snapshot: Snapshot) -> list[PodView]:
    """Every process on a healthy device of the snapshot, as a subject (``pid/<pid>``)."""
    pids = sorted({p.pid for gpu in snapshot.gpus if gpu.state is DeviceState.OK for p in gpu.processes})
    return [PodView(namespace=PROCESS_NAMESPACE, name=process_subject(pid)) for pid in pids]


def one_line(command: str) -> str:
    """A command line on one line, runs of whitespace as one space (``python -c`` scripts have newlines)."""
    return " ".join(command.split())


def short_command(command: str, width: int = COMMAND_WIDTH) -> str:
    """``/usr/bin/python3 train.py --lr 3e-4`` as ``python3 train.py --lr 3e-4``, cut to ``width``.

    The executable's directory is left out (its basename says what runs); the arguments say
    which script, so they stay, as far as ``width`` allows; a cut one ends in :data:`ELLIPSIS`.
    """
    words = command.split()
    if not words:
        return ""
    words[0] = words[0].rstrip("/").rsplit("/", 1)[-1] or words[0]
    text = " ".join(words)
    if len(text) <= width:
        return text
    return text[: max(0, width - len(ELLIPSIS))].rstrip() + ELLIPSIS


def device_name(gpu: GpuSample) -> str:
    """How the display names a device: ``GPU 0``, or ``GPU 0 MIG-…`` for a MIG instance."""
    return f"GPU {gpu.index}" if gpu.mig_id is None else f"GPU {gpu.index} {gpu.mig_id}"


@dataclass(frozen=True, slots=True)
class GpuRow:
    """One device as last sampled, with the active findings that speak for it."""

    device: str
    """Device key: the GPU (or MIG device) UUID."""
    name: str
    model: str
    state: DeviceState
    utilization: float | None
    sm_active: float | None
    memory_used: float | None
    memory_total: float | None
    subjects: tuple[str, ...]
    """Display names of the pods or processes on it."""
    findings: tuple[str, ...]
    """Rules with an active finding on it."""
    allocated: float | None = None
    """What live tensors hold, summed over the processes whose training hook reports it (None: no hook)."""
    reserved: float | None = None
    """What the processes' caching allocators hold, from their hooks (None: no hook)."""
    shares: tuple[ShareRow, ...] = ()
    """On a shared GPU (more than one subject), each subject's own readings; empty otherwise."""


@dataclass(frozen=True, slots=True)
class ShareRow:
    """One pod or process on a shared GPU: its own readings, as the engine judges them."""

    subject: str
    """Display name."""
    utilization: float | None
    """Its per-process SM utilization (the sum over its processes), as last read."""
    memory_used: float | None
    """The sum of its processes' memory."""
    findings: tuple[str, ...]
    """Rules with an active finding on it, on this GPU."""
    allocated: float | None = None
    """Its processes' live tensors, from their training hook (None: not hooked)."""
    reserved: float | None = None
    """Its processes' allocator cache, from their training hook (None: not hooked)."""


@dataclass(frozen=True, slots=True)
class ScaleNote:
    """A scale decision that changes the target's replicas (only the simulated ones: see the module doc)."""

    policy: str
    target: str
    """``Deployment inference/llm-server``."""
    decision: ScaleDecision
    at: float
    applied: bool
    """Whether the simulated target took it (False: the policy is ``dryRun``, its replicas stay)."""
    namespace: str = ""
    """The target's namespace (the policy's; ``""`` for a policy without one)."""
    name: str = ""
    """The target's name."""


@dataclass(slots=True)
class SimulatedTarget:
    """A policy's scale target in local mode: a replica count that follows the decisions."""

    policy: str
    target: str
    """``Deployment inference/llm-server``."""
    initial: int
    """Replicas when the policy first matched pods: one per matched pod."""
    replicas: int
    dry_run: bool
    """The policy's ``dryRun``: decisions are announced, the replicas stay at ``initial``."""
    scaled_up: int = 0
    scaled_down: int = 0

    def apply(self, decision: ScaleDecision) -> None:
        """Take a decision that changes the replicas, as a patched ``/scale`` would."""
        if decision.desired > self.replicas:
            self.scaled_up += 1
        elif decision.desired < self.replicas:
            self.scaled_down += 1
        self.replicas = decision.desired

    @property
    def row(self) -> TargetRow:
        """The target as the display shows it."""
        return TargetRow(self.policy, self.target, self.replicas, self.dry_run)


class SimulatedScaler:
    """Scales one policy's :class:`SimulatedTarget` after each evaluation, as the WorkloadScaler would."""

    def __init__(self, policy: LocalPolicy) -> None:
        self.policy = policy
        self.decider = ScaleDecider()
        self.target: SimulatedTarget | None = None
        """None until the policy first matches a pod (nothing to size the target by before)."""

    def scale(self, evaluation: Evaluation, now: float) -> ScaleNote | None:
        """One scale step after ``evaluation``; a note when it changes (dryRun: would change) the replicas."""
        action = self.policy.spec.actions.scale
        matched = len(evaluation.matched_pods)
        if action is None:
            return None
        target = self.target
        if target is None:
            if matched == 0:
                # Nothing to size the Deployment by yet; the operator would read /scale instead.
                return None
            ref = action.target_ref
            where = f"{self.policy.namespace}/{ref.name}" if self.policy.namespace else ref.name
            target = self.target = SimulatedTarget(
                policy=self.policy.key,
                target=f"{ref.kind} {where}",
                initial=matched,
                replicas=matched,
                dry_run=action.dry_run,
            )
        step = scale_step(
            self.decider, action, target.replicas, evaluation.active, matched, now, evaluation.load
        )
        if step.kind is StepKind.HOLD:
            return None
        applied = step.kind is StepKind.APPLY
        if applied:
            target.apply(step.decision)
        step.settle(made=applied)
        return ScaleNote(
            self.policy.key,
            target.target,
            step.decision,
            now,
            applied=applied,
            namespace=self.policy.namespace or "",
            name=action.target_ref.name,
        )


@dataclass(frozen=True, slots=True)
class TargetRow:
    """A simulated scale target's replicas at one step, for the table and the status lines."""

    policy: str
    target: str
    replicas: int
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Announcement:
    """A finding that started, re-notified or cleared, with the names the display needs."""

    transition: FindingTransition
    subject: str
    devices: tuple[str, ...]
    """Display names of the GPUs it speaks for (``GPU 1``)."""


@dataclass(frozen=True, slots=True)
class Step:
    """What one snapshot changed."""

    at: float
    rows: tuple[GpuRow, ...]
    announcements: tuple[Announcement, ...]
    scaling: tuple[ScaleNote, ...]
    evaluated: bool
    """Whether any policy was evaluated at this snapshot."""
    targets: tuple[TargetRow, ...] = ()
    """The simulated scale targets after this step (none before a scaling policy matched a pod)."""


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
        self._pods_of: PodsOf = pods_of or (processes_in if subjects is SubjectKind.PROCESSES else pods_in)
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
        points = list(self._points(snapshot))
        self.store.extend(points)
        self.health.observe(snapshot, subjects=self._health_subjects)
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

    def _health_subjects(self, gpu: GpuSample) -> list[PodId]:
        if self.subjects is SubjectKind.PROCESSES:
            return [PodId(PROCESS_NAMESPACE, process_subject(p.pid)) for p in gpu.processes]
        return pods_of(gpu)

    def _record_judged(self, evaluation: Evaluation) -> None:
        """The service rules' values, for the plot: no GPU reading shows what they judge."""
        for outcome in evaluation.outcomes:
            if rule_type(outcome.kind).metric is not None:
                subject = self.subject_name(outcome.pod.namespace, outcome.pod.name)
                self.history.judge(
                    subject,
                    outcome.rule,
                    outcome.kind,
                    outcome.unit,
                    outcome.threshold,
                    evaluation.at,
                    outcome.value,
                )

    def _points(self, snapshot: Snapshot) -> Iterator[tuple[SeriesKey, Point]]:
        if self.subjects is SubjectKind.PROCESSES:
            return points_from_processes(snapshot)
        return points_from_snapshot(snapshot)

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
                subject = (
                    PodId(PROCESS_NAMESPACE, process_subject(proc.pid))
                    if self.subjects is SubjectKind.PROCESSES
                    else (PodId(proc.pod.namespace, proc.pod.name) if proc.pod else None)
                )
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
