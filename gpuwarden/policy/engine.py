"""PolicyEvaluator: one policy's rules applied to the pods it selects, findings kept across evaluations.

Pure: pods, samples and ``now`` come in; transitions and verdicts go out. The
operator (or local mode) calls :meth:`PolicyEvaluator.evaluate` every
``evaluationInterval`` and turns transitions into Events, status and scaling.

One evaluation, in order:

1. **Selection.** Pods in the evaluator's namespace (all, when it has none)
   whose labels match the policy's selector. Pods without GPU series are
   selected too (they simply have nothing to judge).
2. **Snooze.** A pod annotated ``snooze.gpuwarden.dev/<rule-name>: <RFC3339 time>``
   is not judged by that rule until that time; an active finding resolves with
   ``Snoozed``. An annotation that does not parse is ignored.
3. **Rules**, in spec order, per pod in (namespace, name) order: each yields an
   :class:`~gpuwarden.policy.rules.common.Outcome`, which the
   :class:`~gpuwarden.policy.findings.FindingTracker` turns into a transition.
4. **Sweep.** Active findings whose rule left the spec (or changed kind)
   resolve with ``RuleRemoved``; those whose pod is no longer selected with
   ``NotSelected``; those whose pod is not in the list at all with ``PodGone``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from gpuwarden.kubetime import parse_epoch
from gpuwarden.policy.findings import (
    Finding,
    FindingKey,
    FindingTracker,
    FindingTransition,
    Resolution,
    Transition,
)
from gpuwarden.policy.rules import RULE_TYPES, Memo, type_of
from gpuwarden.policy.rules.common import JudgeContext, Outcome, RuleKind, Services, WindowParams, unknown
from gpuwarden.policy.scaling.predictive import WorkloadLoad, request_load, workload_load
from gpuwarden.policy.spec.model import ForecastLoad, PolicySpec, Rule
from gpuwarden.policy.spec.selector import selector_matches
from gpuwarden.policy.store.health import HealthStore
from gpuwarden.policy.store.series import PodId, SeriesKey, SeriesStore, Window
from gpuwarden.policy.store.service import ServiceStore

SNOOZE_PREFIX = "snooze.gpuwarden.dev/"
"""Annotation prefix; the rule's name follows it."""

HORIZON_SLACK_SECONDS = 30.0
"""Retention beyond what the rules read: keeps the sample just before a window (it covers the window's
start; see :func:`gpuwarden.policy.rules.common.covered`) and absorbs clock jitter."""

DEFAULT_NO_DATA_SECONDS = 600.0
"""An active finding whose pod sent nothing usable this long resolves with ``NoData``."""


@dataclass(frozen=True, slots=True)
class PodView:
    """What the engine needs to know of a pod."""

    namespace: str
    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def id(self) -> PodId:
        """The pod's (namespace, name)."""
        return PodId(self.namespace, self.name)


@dataclass(frozen=True, slots=True)
class Evaluation:
    """The result of one evaluation of one policy."""

    at: float
    transitions: tuple[FindingTransition, ...]
    """Every active finding's step (STARTED, ONGOING, RENOTIFY, RESOLVED), in a stable order."""
    active: tuple[Finding, ...]
    """Findings active after this evaluation, newest first."""
    matched_pods: tuple[PodId, ...]
    """Pods the policy selects, sorted."""
    violating_pods: tuple[PodId, ...]
    """Selected pods with at least one active finding, sorted."""
    outcomes: tuple[Outcome, ...] = ()
    """Every rule's verdict on every selected, unsnoozed pod (for metrics and local mode's display)."""
    load: WorkloadLoad | None = None
    """With ``actions.scale.forecast``: the selected pods' load over the last interval, for the forecast."""

    def announcements(self) -> list[FindingTransition]:
        """Transitions that announce something: STARTED, RENOTIFY and RESOLVED (ONGOING left out)."""
        return [t for t in self.transitions if t.transition is not Transition.ONGOING]


def rule_kind(rule: Rule) -> RuleKind:
    """The kind of a rule."""
    return type_of(rule).kind


def horizon_seconds(spec: PolicySpec, params: WindowParams | None = None) -> float:
    """The store retention this policy needs: its longest reach back, plus staleness and slack.

    A rule reaches back its window (its kind's ``reach``; memoryGrowth: its window plus one bucket,
    see :func:`gpuwarden.policy.rules.growth.shape.growth_window`) from the pod's newest
    sample, which may be up to ``stale_after_seconds`` old. Size the store's
    ``retention_seconds`` as the largest horizon over all policies.
    """
    params = params or WindowParams()
    longest = max((type_of(r).reach(r) for r in spec.rules), default=0.0)
    return longest + params.stale_after_seconds + HORIZON_SLACK_SECONDS


def evaluate_rule(
    rule: Rule,
    pod: PodId,
    series: Sequence[tuple[SeriesKey, Window]],
    now: float,
    params: WindowParams,
    memo: Memo | None = None,
    health: HealthStore | None = None,
    services: Services | None = None,
) -> Outcome:
    """Judge one rule for one pod (its kind's evaluator); ``memo`` is what its kind keeps between
    evaluations (memoryGrowth: a :class:`~gpuwarden.policy.rules.growth.GrowthCache`), if any.

    ``health`` is what gpuHealth judges, and what puts throttling beside utilization findings
    (:mod:`gpuwarden.policy.rules.gpu_health`); without it gpuHealth has nothing to judge.
    ``services``: the pods' own metrics, what the service kinds judge (those whose record reads a
    ``metric``); without them those have nothing to judge.
    """
    return type_of(rule).evaluate(rule, JudgeContext(pod, series, now, params, health, services), memo)


def snoozed_until(annotations: Mapping[str, str], rule_name: str) -> float | None:
    """The epoch second until which ``rule_name`` is snoozed on a pod, or None (absent or unparsable).

    The value is an RFC 3339 time (``2026-12-03T08:00:00Z``); one without an offset is read as UTC.
    """
    raw = annotations.get(SNOOZE_PREFIX + rule_name)
    return None if raw is None else parse_epoch(raw.strip())


class PolicyEvaluator:
    """Evaluates one policy; holds that policy's findings between evaluations.

    ``policy_key`` names the policy in findings (``namespace/name``).
    ``namespace`` limits it to pods of that namespace (a namespaced policy);
    None evaluates every pod it is given (local mode). ``params`` sets how
    windows are judged; ``no_data_seconds`` how long an active finding survives
    without usable data (a node gone quiet, a restart still replaying).
    """

    def __init__(
        self,
        policy_key: str,
        spec: PolicySpec,
        *,
        namespace: str | None = None,
        params: WindowParams | None = None,
        no_data_seconds: float = DEFAULT_NO_DATA_SECONDS,
    ) -> None:
        self.policy_key = policy_key
        self.namespace = namespace
        self.params = params or WindowParams()
        self.spec = spec
        self._memos: dict[RuleKind, Memo] = {t.kind: t.memo() for t in RULE_TYPES if t.memo is not None}
        self._tracker = FindingTracker(
            policy_key, renotify_seconds=spec.actions.renotify_seconds, no_data_seconds=no_data_seconds
        )

    def update_spec(self, spec: PolicySpec) -> None:
        """Switch to an edited spec, keeping the findings of rules that still exist with the same kind.

        Findings of removed (or re-kinded) rules resolve at the next evaluation with ``RuleRemoved``.
        """
        self.spec = spec
        self._tracker.renotify_seconds = spec.actions.renotify_seconds

    def restore(self, findings: Iterable[Finding], now: float) -> None:
        """Seed active findings after a restart (from the policy's status), so they are not announced again.

        They count as announced at ``now`` and resolve like any other, or with
        ``NoData`` if their pod's data does not come back within ``no_data_seconds``.
        """
        self._tracker.restore(findings, now)

    def active(self) -> list[Finding]:
        """Active findings, newest first."""
        return self._tracker.active()

    def horizon_seconds(self) -> float:
        """The store retention this policy needs (see :func:`horizon_seconds`)."""
        return horizon_seconds(self.spec, self.params)

    def _select(self, pods: Iterable[PodView]) -> tuple[set[PodId], dict[PodId, PodView]]:
        """The pods of the evaluator's namespace, and those of them the selector matches."""
        present: set[PodId] = set()
        selected: dict[PodId, PodView] = {}
        for pod in pods:
            if self.namespace is not None and pod.namespace != self.namespace:
                continue
            pod_id = PodId(pod.namespace, pod.name)
            present.add(pod_id)
            if selector_matches(self.spec.selector, pod.labels):
                selected[pod_id] = pod
        return present, selected

    def judge(
        self,
        pods: Iterable[PodView],
        store: SeriesStore,
        now: float,
        health: HealthStore | None = None,
        *,
        services: ServiceStore | None = None,
    ) -> dict[PodId, list[Outcome]]:
        """Every rule's outcome on every selected pod as of ``now``, findings left alone.

        What a shard that does not own the policy sends its owner (sharded mode); a rule
        snoozed on a pod is left out (the owner sees the annotation too).
        """
        _, selected = self._select(pods)
        scrapes = None if services is None else Services(services, tuple(sorted(selected)))
        judged: dict[PodId, list[Outcome]] = {}
        for pod_id in sorted(selected):
            pod = selected[pod_id]
            context = JudgeContext(pod_id, store.series_of(*pod_id), now, self.params, health, scrapes)
            snoozes = any(k.startswith(SNOOZE_PREFIX) for k in pod.annotations)
            out = judged[pod_id] = []
            for rule in self.spec.rules:
                if snoozes:
                    until = snoozed_until(pod.annotations, rule.name)
                    if until is not None and now < until:
                        continue
                t = type_of(rule)
                out.append(t.evaluate(rule, context, self._memos.get(t.kind)))
        self._sweep()
        return judged

    def _sweep(self) -> None:
        for memo in self._memos.values():
            memo.sweep()

    def evaluate(
        self,
        pods: Iterable[PodView],
        store: SeriesStore,
        now: float,
        health: HealthStore | None = None,
        *,
        elsewhere: Mapping[PodId, Sequence[Outcome]] | None = None,
        services: ServiceStore | None = None,
    ) -> Evaluation:
        """Apply every rule to every selected pod as of ``now``; return the transitions and verdicts.

        ``health``: the GPUs' health (gpuHealth rules, throttling beside utilization findings).
        ``services``: the pods' own metrics as scraped (what the service kinds judge).
        ``elsewhere``: pods judged by another shard (sharded mode), with the outcomes it sent
        (:meth:`judge`); the rules are not run on them here, and a rule with no outcome among
        theirs had nothing to judge.
        """
        tracker = self._tracker
        rules = {r.name: r for r in self.spec.rules}
        # Per rule, once: its kind, the `for` the tracker applies (memoryGrowth only), its kind's
        # evaluator and memo.
        plan = [
            (rule, t.kind, 0.0 if t.hold is None else t.hold(rule), t.evaluate, self._memos.get(t.kind))
            for rule in self.spec.rules
            for t in (type_of(rule),)
        ]
        present, selected = self._select(pods)
        remote = elsewhere or {}
        # A per-replica figure is over the pods judged here (another shard's send their verdicts).
        scrapes: Services | None = None
        if services is not None:
            scrapes = Services(services, tuple(p for p in sorted(selected) if p not in remote))

        transitions: list[FindingTransition] = []
        outcomes: list[Outcome] = []
        for pod_id in sorted(selected):
            pod = selected[pod_id]
            namespace, name = pod_id
            sent = remote.get(pod_id)
            context = (
                JudgeContext(pod_id, store.series_of(namespace, name), now, self.params, health, scrapes)
                if sent is None
                else None
            )
            by_rule = {o.rule: o for o in sent} if sent is not None else {}
            snoozes = any(k.startswith(SNOOZE_PREFIX) for k in pod.annotations)
            for rule, kind, for_seconds, judge, memo in plan:
                key = FindingKey(rule.name, namespace, name)
                state = tracker.state(key)
                if state is not None and state.finding.kind != kind:
                    _append(transitions, tracker.resolve(key, Resolution.RULE_REMOVED, now))
                if snoozes:
                    until = snoozed_until(pod.annotations, rule.name)
                    if until is not None and now < until:
                        _append(transitions, tracker.resolve(key, Resolution.SNOOZED, now))
                        continue
                if context is not None:
                    outcome = judge(rule, context, memo)
                else:
                    outcome = by_rule.get(rule.name) or unknown(rule.name, kind, pod_id, 0.0, "")
                outcomes.append(outcome)
                _append(transitions, tracker.observe(outcome, now, for_seconds, key=key))

        ending: list[tuple[FindingKey, Resolution]] = []
        for key in tracker.active_keys():
            rule_now = rules.get(key.rule)
            state = tracker.state(key)
            if rule_now is None or (state is not None and state.finding.kind != rule_kind(rule_now)):
                ending.append((key, Resolution.RULE_REMOVED))
            elif (key.namespace, key.pod) not in selected:
                gone = (key.namespace, key.pod) not in present
                ending.append((key, Resolution.POD_GONE if gone else Resolution.NOT_SELECTED))
        for key, cause in sorted(ending):
            _append(transitions, tracker.resolve(key, cause, now))
        for key in tracker.pending_keys():
            if key.rule not in rules or (key.namespace, key.pod) not in selected:
                tracker.forget_pending(key)

        self._sweep()
        scale = self.spec.actions.scale
        load = None
        interval = self.spec.evaluation_interval_seconds
        if scale is not None and scale.forecast is not None:
            if scale.forecast.load is ForecastLoad.REQUESTS:
                if services is not None:
                    every = Services(services, tuple(sorted(selected)))
                    load = request_load(every, scale.forecast, now, interval, self.params)
            else:
                load = workload_load(
                    (store.series_of(*pod_id) for pod_id in sorted(selected)),
                    scale.forecast,
                    now,
                    interval,
                    self.params,
                )
        active = tracker.active()
        violating = sorted({PodId(f.namespace, f.pod) for f in active})
        return Evaluation(
            at=now,
            transitions=tuple(transitions),
            active=tuple(active),
            matched_pods=tuple(sorted(selected)),
            violating_pods=tuple(violating),
            outcomes=tuple(outcomes),
            load=load,
        )


def _append(out: list[FindingTransition], transition: FindingTransition | None) -> None:
    if transition is not None:
        out.append(transition)
