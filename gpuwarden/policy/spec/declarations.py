"""The spec's own fields, declared once (:mod:`gpuwarden.policy.spec.schema`): evaluationInterval,
serviceMetrics, a rule's name and actions. The rule kinds declare their bodies in their modules.

:func:`gpuwarden.policy.parse.parse_spec` reads these, and ``make crds`` renders the CRD's schema from
them (:mod:`gpuwarden.policy.crd`). The selector (Kubernetes' own LabelSelector) and the status stay
written by hand in the CRD.
"""

from __future__ import annotations

from gpuwarden.policy.spec.model import BUCKET_SECONDS, MAX_STEPS, ForecastLoad, ReclaimMethod, Scheme, Server
from gpuwarden.policy.spec.schema import (
    Boolean,
    Check,
    Choice,
    Duration,
    Integer,
    IntOrPercent,
    Names,
    Number,
    Object,
    Text,
)
from gpuwarden.units import format_duration

__all__ = [
    "ACTIONS",
    "BEHAVIOR",
    "DNS_LABEL",
    "DNS_SUBDOMAIN",
    "EVALUATION_INTERVAL",
    "EVENTS",
    "FORECAST",
    "GRACE_PERIOD",
    "HORIZON",
    "LOAD",
    "MAX_PER_HOUR",
    "MAX_REPLICAS",
    "MAX_RULES",
    "MAX_UNCERTAINTY",
    "METRICS_PATH",
    "METRICS_PORT",
    "METRICS_SCHEME",
    "METRICS_SERVER",
    "MIN_REPLICAS",
    "RECLAIM",
    "RECLAIM_ACTION",
    "RECLAIM_DRY_RUN",
    "RECLAIM_RULES",
    "RENOTIFY_INTERVAL",
    "REQUESTS_PER_REPLICA",
    "RULE_NAME",
    "SCALE",
    "SCALE_DOWN",
    "SCALE_DOWN_ON",
    "SCALE_DRY_RUN",
    "SCALE_UP",
    "SCALE_UP_MIN_PODS",
    "SCALE_UP_ON",
    "SCRAPE_INTERVAL",
    "SERVICE_METRICS",
    "TARGET_API_VERSION",
    "TARGET_KIND",
    "TARGET_NAME",
    "TARGET_REF",
]

DNS_LABEL = "[a-z0-9]([-a-z0-9]*[a-z0-9])?"
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"

MAX_RULES = 32
"""Rules in a policy (and rule names in a list of them): the CRD needs a bound for CEL's cost."""

EVALUATION_INTERVAL = Duration(
    "evaluationInterval",
    "How often the operator evaluates this policy's rules and refreshes its status (a duration such as"
    " 10s). Rules still see every sample; this bounds how late a violation is noticed and how often"
    " status is written.",
    default="10s",
    minimum="1s",
)

_RULE_NAMES = "The name of a rule in spec.rules."

RULE_NAME = Text(
    "name",
    "The rule's name (a DNS label): it appears in Events and status, is what actions.scale refers to,"
    " and names the snooze annotation snooze.gpuwarden.dev/<name>.",
    max_length=63,
    pattern=DNS_LABEL,
    message="must be a DNS label such as idle-gpu: lower-case letters, digits and '-', starting and ending"
    " with a letter or digit",
    required=True,
)

METRICS_PORT = Integer(
    "port",
    "The pod's port serving the metrics; wins over the pod's prometheus.io/port annotation and"
    " its container port named metrics.",
    minimum=1,
    maximum=65535,
)

METRICS_PATH = Text(
    "path",
    "The URL path of the metrics (such as /metrics); wins over the pod's prometheus.io/path"
    " annotation. Default: the annotation, else /metrics.",
    min_length=None,
    max_length=256,
    pattern="/[-!$&'()*+,;=:@A-Za-z0-9._~/%]*",
    message="must be a URL path such as /metrics (no query, no space)",
)

METRICS_SCHEME = Choice(
    "scheme",
    "http or https (the agent scrapes by pod IP and does not verify the pod's certificate).",
    choices=Scheme,
    default=Scheme.HTTP,
)

SCRAPE_INTERVAL = Duration(
    "interval",
    "How often each pod is scraped (a duration such as 15s, at least 1s). Default: the policy's"
    " evaluationInterval.",
    minimum="1s",
    label="serviceMetrics.interval",
)

METRICS_SERVER = Choice(
    "server",
    "The inference server the pods run, whose metric names the service rules read when a rule"
    " names neither its own server nor a metric: vllm, sglang, triton or tgi"
    " (text-generation-inference, archived upstream).",
    choices=Server,
)

RECLAIM_RULES = Names(
    "rules",
    "The rules whose findings make a pod idle: utilizationFloor rules, or idleGpus rules with"
    " action Annotate (another GPU of the pod works).",
    item="A rule's name.",
    min_items=1,
    max_items=MAX_RULES,
    max_length=RULE_NAME.max_length,
    required=True,
)

RECLAIM_ACTION = Choice(
    "action",
    "ScaleToZero (a Deployment, StatefulSet or LeaderWorkerSet: spec.replicas 0), Suspend (a batch"
    " Job, JobSet or RayCluster: spec.suspend; a Job Kueue admits: its Workload's spec.active"
    " false), or Annotate (only mark the workload gpuwarden.dev/reclaimed-at).",
    choices=ReclaimMethod,
    required=True,
)

GRACE_PERIOD = Duration(
    "gracePeriod",
    "How long after the warning the workload is reclaimed if it stays idle (a duration, at least 10s).",
    default="10m",
    minimum="10s",
)

MAX_PER_HOUR = Integer(
    "maxPerHour",
    "The most workloads this policy reclaims in any hour; past it, due reclaims wait (a circuit"
    " breaker, said in the ReclaimActive condition and an Event).",
    int32=True,
    minimum=1,
    maximum=1000,
    default=5,
)

RECLAIM_DRY_RUN = Boolean(
    "dryRun",
    "Warn and announce (WouldReclaim Events, status.reclaim) without changing any workload; set"
    " false to act.",
    default=True,
)

HORIZON = Duration(
    "horizon",
    "How far ahead to look (a duration, 10s to 1h). Unset: the workload's observed replica"
    " start-up time, the median of its last five scale-ups from the change to every pod carrying"
    " load (3m until one is seen).",
    # At least one evaluation ahead, and at most as far as the forecast looks.
    minimum="10s",
    maximum=format_duration(MAX_STEPS * BUCKET_SECONDS),
)

MAX_UNCERTAINTY = Number(
    "maxUncertainty",
    "The widest 80% prediction interval, in percentage points of utilization per replica (load:"
    " requests: in percent of requestsPerReplica), the forecast may act on; a wider one (an unsure"
    " forecast: a burst, a load unlike its past) leaves the decision to the rules.",
    minimum=1,
    maximum=100,
    default=20,
)

LOAD = Choice(
    "load",
    "What to forecast. utilization: the pods' summed GPU utilization, against the first"
    " utilizationCeiling rule in scaleUpOn. requests: the rate of requests the pods serve, read"
    " from their own metrics (their server's counter of requests served, else the count of a"
    " requestLatency rule's histogram), against requestsPerReplica; it needs a requestLatency,"
    " requestQueue or kvCacheUsage rule in scaleUpOn, and never holds a scale-down back.",
    choices=ForecastLoad,
    default=ForecastLoad.UTILIZATION,
)

REQUESTS_PER_REPLICA = Number(
    "requestsPerReplica",
    "load: requests only (and required there): the requests per second one replica serves within"
    " its targets; the forecast scales up ahead of the rate passing it.",
    minimum=0,
    maximum=1_000_000,
    above=True,
)

TARGET_API_VERSION = Text(
    "apiVersion", "API version of the target, e.g. apps/v1.", max_length=253, required=True
)

TARGET_KIND = Text(
    "kind",
    "Kind of the target, e.g. Deployment.",
    max_length=63,
    pattern="[A-Z][A-Za-z0-9]*",
    required=True,
)

TARGET_NAME = Text("name", "Name of the target.", max_length=253, pattern=DNS_SUBDOMAIN, required=True)

MIN_REPLICAS = Integer(
    "minReplicas", "Never scale below this many replicas.", int32=True, minimum=1, default=1
)

MAX_REPLICAS = Integer(
    "maxReplicas", "Never scale above this many replicas.", int32=True, minimum=1, required=True
)

SCALE_UP_ON = Names(
    "scaleUpOn",
    "Names of rules whose violations call for more replicas.",
    item=_RULE_NAMES,
    max_items=MAX_RULES,
    max_length=RULE_NAME.max_length,
    defaulted=True,
)

SCALE_DOWN_ON = Names(
    "scaleDownOn",
    "Names of rules whose violations call for fewer replicas; the target scales down only when"
    " every selected pod violates one of them.",
    item=_RULE_NAMES,
    max_items=MAX_RULES,
    max_length=RULE_NAME.max_length,
    defaulted=True,
)

SCALE_UP_MIN_PODS = IntOrPercent(
    "scaleUpMinPods",
    "how many selected pods must violate a scaleUpOn rule before scaling up, a count (e.g. 1) or a"
    " percentage of the selected pods (e.g. 50%, rounded up).",
    default=1,
    percent="(100|[1-9][0-9]?)%",
    span="1% to 100%",
)

SCALE_DRY_RUN = Boolean(
    "dryRun",
    "Compute and report scaling decisions (status.scale, Events) without changing the target's replicas.",
    default=False,
)

EVENTS = Boolean(
    "events",
    "Emit a Warning Event on the pod and on the policy when a violation starts (and again every"
    " renotifyInterval while it lasts), and a Normal Event when it clears.",
    default=True,
)

RENOTIFY_INTERVAL = Duration(
    "renotifyInterval",
    "How often a violation that is still active is announced again; never more often than this"
    " (a duration, at least 1m).",
    default="1h",
    minimum="1m",
)

SERVICE_METRICS = Object(
    "serviceMetrics",
    "Where the node agents scrape the selected pods' own Prometheus metrics (an inference server's"
    " /metrics), for the rules that read them: requestLatency, requestQueue and kvCacheUsage. Each pod"
    " is scraped by the agent on its node, by pod IP, keeping only the metrics those rules name. Port"
    " and path: the ones set here; else the pod's prometheus.io/port and prometheus.io/path"
    " annotations; else its container port named metrics, and /metrics. A pod with no port to scrape"
    " is reported in the policy's conditions.",
    fields=(
        METRICS_PORT,
        METRICS_PATH,
        METRICS_SCHEME,
        SCRAPE_INTERVAL,
        METRICS_SERVER,
    ),
)


RECLAIM = Object(
    "reclaim",
    "Give the GPUs of an idle workload back (docs/reclaim.md): when every selected pod of a workload"
    " (its pods' top owner) has an active finding of one of these rules and none worked in the last"
    " evaluation interval, warn (an Event on the workload and its pods naming the action and when),"
    " wait gracePeriod (real work cancels it), then scale it to zero, suspend it or annotate it,"
    " recording what it changed so that `gpuwarden restore` puts it back. Opt out with the annotation"
    ' gpuwarden.dev/reclaim: "false" on the workload or its namespace. The operator needs the chart\'s'
    " operator.reclaim.enabled (its RBAC).",
    fields=(
        RECLAIM_RULES,
        RECLAIM_ACTION,
        GRACE_PERIOD,
        MAX_PER_HOUR,
        RECLAIM_DRY_RUN,
    ),
)


def _direction(up: bool, stabilization: str, cooldown: str, summary: str) -> Object:
    """behavior.scaleUp or behavior.scaleDown, with that direction's defaults."""
    way, verb = ("up", "added") if up else ("down", "removed")
    return Object(
        f"scale{way.title()}",
        summary,
        fields=(
            Duration(
                "stabilizationWindow",
                f"The wish to scale {way} must hold for this long before acting (a duration"
                + ("; 0s acts at once)." if up else ")."),
                default=stabilization,
            ),
            IntOrPercent(
                "step",
                f"replicas {verb} per scaling step, a count (e.g. 1) or a percentage of the current"
                " replicas (e.g. 50%, rounded up, at least 1).",
                default=1,
                percent="[1-9][0-9]{0,2}%",
                span="1% to 999%",
            ),
            Duration(
                "cooldown",
                "The least time between two scaling steps in this direction (a duration).",
                default=cooldown,
            ),
        ),
        defaulted=True,
    )


FORECAST = Object(
    "forecast",
    "Scale ahead of the load (docs/scaling.md#forecast-driven-scaling): forecast the workload's"
    " utilization per replica (its pods' summed utilization over the target's replicas, in minutes,"
    " with a damped trend and, once a day of history is kept, a daily season) with an 80% prediction"
    " interval. Scale up when the forecast a horizon ahead exceeds the percent of the first"
    " utilizationCeiling rule in scaleUpOn (which it needs), even before any pod is saturated; hold a"
    " scale-down by the rules back while the interval's upper end reaches the percent of the first"
    " utilizationFloor rule in scaleDownOn within the horizon. While the history is short (10 minutes)"
    " or the interval wider than maxUncertainty, the rules decide alone. An empty object ({}) turns it"
    " on with the defaults.",
    fields=(
        HORIZON,
        MAX_UNCERTAINTY,
        LOAD,
        REQUESTS_PER_REPLICA,
    ),
    checks=(
        Check(
            "(self.load == 'requests') == has(self.requestsPerReplica)",
            "requestsPerReplica is required with load requests, and only there",
        ),
    ),
)

TARGET_REF = Object(
    "targetRef",
    "The workload to scale, in the policy's namespace; any resource with a /scale subresource"
    " (Deployment, StatefulSet, ...).",
    fields=(
        TARGET_API_VERSION,
        TARGET_KIND,
        TARGET_NAME,
    ),
    # Kubernetes' own groups have four scalable kinds; a custom resource's /scale is checked
    # when the operator reads it (ScaleTargetNotScalable). The parser's _scalable says the same.
    checks=(
        Check(
            "self.apiVersion == 'v1' ? self.kind == 'ReplicationController'"
            " : self.apiVersion.startsWith('apps/')"
            " ? self.kind in ['Deployment', 'StatefulSet', 'ReplicaSet']"
            " : !self.apiVersion.matches('^([a-z.]+\\\\.k8s\\\\.io|batch|autoscaling|policy|extensions)/')",
            "targetRef must name a kind with a /scale subresource: Deployment, StatefulSet or"
            " ReplicaSet (apps/v1), ReplicationController (v1), or a custom resource that has one",
            ".kind",
        ),
    ),
    required=True,
)

SCALE_UP = _direction(
    True, "0s", "1m", "Scaling up. Defaults react at once (no stabilization), 1 replica a step, 1m apart."
)
SCALE_DOWN = _direction(
    False, "5m", "5m", "Scaling down. Defaults wait 5m of stable wish, 1 replica a step, 5m apart."
)
BEHAVIOR = Object(
    "behavior", "How fast to move in each direction.", fields=(SCALE_UP, SCALE_DOWN), defaulted=True
)


SCALE = Object(
    "scale",
    "Scale a workload (through its /scale subresource) on rule violations of the selected pods,"
    " HPA-style: up on scaleUpOn rules, down on scaleDownOn rules, always within [minReplicas,"
    " maxReplicas].",
    fields=(
        TARGET_REF,
        MIN_REPLICAS,
        MAX_REPLICAS,
        SCALE_UP_ON,
        SCALE_DOWN_ON,
        SCALE_UP_MIN_PODS,
        BEHAVIOR,
        SCALE_DRY_RUN,
        FORECAST,
    ),
    checks=(
        # Only when both are in range: maxReplicas 0 is its own field's error, and must not add one
        # about the defaulted minReplicas.
        Check(
            "!has(self.minReplicas) || self.minReplicas < 1 || self.maxReplicas < 1"
            " || self.minReplicas <= self.maxReplicas",
            "minReplicas must not exceed maxReplicas",
            ".minReplicas",
        ),
        Check(
            "(has(self.scaleUpOn) && size(self.scaleUpOn) > 0)"
            " || (has(self.scaleDownOn) && size(self.scaleDownOn) > 0)",
            "scale needs at least one rule in scaleUpOn or scaleDownOn",
        ),
        Check(
            "!has(self.scaleUpOn) || !has(self.scaleDownOn)"
            " || !self.scaleUpOn.exists(n, n in self.scaleDownOn)",
            "a rule cannot be in both scaleUpOn and scaleDownOn",
            ".scaleDownOn",
        ),
    ),
)

ACTIONS = Object(
    "actions",
    "What to do about violations. Events are on by default; scaling and reclaiming are opt-in.",
    fields=(
        EVENTS,
        RENOTIFY_INTERVAL,
        RECLAIM,
        SCALE,
    ),
    defaulted=True,
)
