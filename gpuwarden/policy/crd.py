"""The GPUMonitorPolicy CRD's schema, rendered from the declarations the parser reads.

``crds/gpuwarden.dev_gpumonitorpolicies.yaml`` is written by hand but for its regions between
``# generated: NAME`` and ``# end generated: NAME``, which :func:`regenerate` renders (``make crds``
runs ``hack/gen-crd.py``):

- ``spec-fields``: ``spec``'s fields after its selector, from
  :mod:`gpuwarden.policy.spec.declarations` (evaluationInterval, serviceMetrics, a rule's name,
  actions) and each rule kind's :class:`~gpuwarden.policy.spec.schema.Body`, with the CEL rule that a
  rule sets exactly one kind;
- ``spec-checks``: the CEL rules on ``spec`` that name kinds by what their records say (which kinds
  reclaim, give a forecast its ceiling, read the pods' own metrics, may only scale up, have a window).

The selector (Kubernetes' own LabelSelector), the rule-name references' CEL rules and the status stay
written by hand. So a new kind's diff is its module, its line in
:data:`~gpuwarden.policy.rules.RULE_TYPES` and the regenerated CRD; ``tests/unit/test_crd_schema.py``
fails while the committed file differs. Pure text in, text out: the script reads and writes the file.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gpuwarden.policy.rules import RULE_TYPES, RuleType
from gpuwarden.policy.spec.declarations import (
    ACTIONS,
    EVALUATION_INTERVAL,
    MAX_RULES,
    RULE_NAME,
    SERVICE_METRICS,
)
from gpuwarden.policy.spec.model import Server
from gpuwarden.policy.spec.schema import Node
from gpuwarden.units import DURATION_PATTERN

__all__ = ["REGIONS", "regenerate", "render", "rules_schema", "spec_checks", "spec_fields"]

WIDTH = 110
"""The longest line the CRD's folded text is wrapped to."""

_Kinds = Sequence[RuleType[Any, Any]]


def _keys(kinds: _Kinds) -> list[str]:
    return [t.key for t in kinds]


def _words(kinds: _Kinds, last: str = "or") -> str:
    """``a, b or c``."""
    keys = _keys(kinds)
    return f" {last} ".join(filter(None, (", ".join(keys[:-1]), keys[-1])))


def _has_any(kinds: _Kinds, var: str = "r") -> str:
    """``has(r.a) || has(r.b)``, parenthesised when there are several."""
    terms = " || ".join(f"has({var}.{k})" for k in _keys(kinds))
    return f"({terms})" if len(kinds) > 1 else terms


def _where(has: Callable[[RuleType[Any, Any]], object]) -> list[RuleType[Any, Any]]:
    return [t for t in RULE_TYPES if has(t)]


def rules_schema() -> Node:
    """``spec.rules``: the rules, each a name and exactly one kind's body."""
    keys = _keys(RULE_TYPES)
    gpus = _where(lambda t: t.metric is None)
    services = _where(lambda t: t.metric is not None)
    return {
        "type": "array",
        "description": "The conditions to check on every selected pod. Each rule has a name unique in the"
        f" policy and exactly one of {', '.join(_keys(gpus))} (the pods' GPUs), {_words(services)} (the"
        " pods' own metrics, see serviceMetrics).",
        "minItems": 1,
        "maxItems": MAX_RULES,
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["name"],
        "items": {
            "type": "object",
            "description": "One named rule; set exactly one rule kind.",
            "required": ["name"],
            "x-kubernetes-validations": [
                {
                    "rule": f"[{', '.join(f'has(self.{k})' for k in keys)}].filter(k, k).size() == 1",
                    "message": f"a rule must set exactly one of {', '.join(keys)}",
                }
            ],
            "properties": {"name": RULE_NAME.openapi(), **{t.key: t.body.openapi() for t in RULE_TYPES}},
        },
    }


def spec_checks() -> list[Node]:
    """The CEL rules on ``spec`` that name rule kinds (the parser enforces each, by the same records)."""
    idle = _where(lambda t: t.idle == "pod")
    some_idle = _where(lambda t: t.idle == "some")
    ceilings = _where(lambda t: t.forecast_ceiling is not None)
    services = _where(lambda t: t.metric is not None)
    up_only = _where(lambda t: t.up_only is not None)
    windows = _where(lambda t: t.body.window is not None)
    reclaimable = " || ".join(
        [
            *(f"has(r.{k})" for k in _keys(idle)),
            *([f"({_has_any(some_idle)} && self.actions.reclaim.action == 'Annotate')"] if some_idle else []),
        ]
    )
    named = f"self.rules.exists(r, r.name == n && ({reclaimable}))"
    reclaim_of = f"self.actions.reclaim.rules.filter(n, !{named})"
    # A rule's window, or '' for a kind without one ([x].all(w, ...) binds x to w; the message maps
    # before it filters, which keeps its estimated cost within the budget).
    window = " : ".join(f"has(r.{t.key}) ? r.{t.key}.{t.body.window}" for t in windows) + " : ''"
    at_least = f"!w.matches('{DURATION_PATTERN}') || duration(w) >= duration(self.evaluationInterval)"
    short = f"w.matches('{DURATION_PATTERN}') && duration(w) < duration(self.evaluationInterval)"
    window_name = " : ".join(f"has(r.{t.key}) ? ': {t.key}.{t.body.window}'" for t in windows[:-1])
    window_name += f" : ': {windows[-1].key}.{windows[-1].body.window}'"
    servers = ", ".join(s.value for s in Server)
    return [
        {
            "rule": "!has(self.actions) || !has(self.actions.reclaim)"
            f" || self.actions.reclaim.rules.all(n, {named})",
            "messageExpression": f"'actions.reclaim.rules must name {_words(idle)} rules of spec.rules (or"
            f" {_words(some_idle)} rules, with action Annotate): ' + {reclaim_of}[0]",
            "fieldPath": ".actions.reclaim.rules",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "!has(self.actions) || !has(self.actions.scale) || !has(self.actions.scale.forecast)"
            " || self.actions.scale.forecast.load == 'requests' || (has(self.actions.scale.scaleUpOn)"
            " && self.actions.scale.scaleUpOn.exists(n, self.rules.exists(r, r.name == n"
            f" && {_has_any(ceilings)})))",
            "message": f"actions.scale.forecast needs a {_words(ceilings)} rule in scaleUpOn: its percent is"
            " the ceiling the forecast is compared with",
            "fieldPath": ".actions.scale.forecast",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "!has(self.actions) || !has(self.actions.scale) || !has(self.actions.scale.forecast)"
            " || self.actions.scale.forecast.load != 'requests' || (has(self.actions.scale.scaleUpOn)"
            " && self.actions.scale.scaleUpOn.exists(n, self.rules.exists(r, r.name == n"
            f" && {_has_any(services)})))",
            "message": f"actions.scale.forecast with load: requests needs a {_words(services)} rule in"
            " scaleUpOn: the pods it reads are scraped, and their server says where the rate is read",
            "fieldPath": ".actions.scale.forecast",
            "reason": "FieldValueInvalid",
        },
        {
            "rule": "!has(self.actions) || !has(self.actions.scale) || !has(self.actions.scale.scaleDownOn)"
            " || self.actions.scale.scaleDownOn.all(n, !self.rules.exists(r, r.name == n"
            f" && {_has_any(up_only)}))",
            "message": f"actions.scale.scaleDownOn names a {_words(up_only)} rule: "
            + "; ".join(dict.fromkeys(str(t.up_only) for t in up_only)),
            "fieldPath": ".actions.scale.scaleDownOn",
            "reason": "FieldValueInvalid",
        },
        # A service rule reads its server's metric, or one it names: it needs a server (its own or
        # serviceMetrics') or a metric.
        {
            "rule": "(has(self.serviceMetrics) && has(self.serviceMetrics.server)) || self.rules.all(r, "
            + " && ".join(f"(!has(r.{k}) || has(r.{k}.server) || has(r.{k}.metric))" for k in _keys(services))
            + ")",
            "message": f"a {_words(services)} rule names no metric: set its server ({servers}) or its"
            " metric, or serviceMetrics.server",
            "fieldPath": ".rules",
            "reason": "FieldValueInvalid",
        },
        # A rule's window must span at least one evaluation interval: a shorter one leaves samples
        # between two evaluations that no evaluation reads. Malformed durations are left to their own
        # fields' rules.
        {
            "rule": f"!self.evaluationInterval.matches('{DURATION_PATTERN}')"
            f" || self.rules.all(r, [({window})].all(w, {at_least}))",
            "messageExpression": f"'rule ' + self.rules.map(r, [({window})].exists(w, {short}) ? r.name +"
            f" ({window_name}) : '').filter(n, n != '')[0] + ' must be at least evaluationInterval (' +"
            " self.evaluationInterval + '): a shorter window leaves samples that no evaluation reads'",
            "fieldPath": ".rules",
            "reason": "FieldValueInvalid",
        },
    ]


def spec_fields() -> Node:
    """The spec's fields after its selector: evaluationInterval, serviceMetrics, rules, actions."""
    return {
        EVALUATION_INTERVAL.name: EVALUATION_INTERVAL.openapi(),
        SERVICE_METRICS.name: SERVICE_METRICS.openapi(),
        "rules": rules_schema(),
        ACTIONS.name: ACTIONS.openapi(),
    }


REGIONS: Mapping[str, Callable[[int], list[str]]] = {
    "spec-fields": lambda indent: [
        line for name, node in spec_fields().items() for line in render(name, node, indent)
    ],
    "spec-checks": lambda indent: [line for check in spec_checks() for line in _item(check, indent)],
}
"""Each generated region of the CRD, by the name its markers carry: its lines at an indentation."""


def regenerate(text: str) -> str:
    """The CRD ``text`` with every generated region rendered anew (the rest left byte for byte)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        found = re.fullmatch(r"( *)# generated: ([a-z-]+)\b.*", line)
        i += 1
        if not found:
            continue
        indent, name = len(found.group(1)), found.group(2)
        end = f"{found.group(1)}# end generated: {name}"
        while i < len(lines) and lines[i] != end:
            i += 1
        if i == len(lines):
            raise ValueError(f"no '# end generated: {name}' after its start")
        out.extend(REGIONS[name](indent))
    return "\n".join(out)


# --- YAML, as the CRD writes it ---------------------------------------------------------------------

_PLAIN = re.compile(r"[A-Za-z0-9(.][A-Za-z0-9 .,;()'/_+-]*")
_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_NOT_PLAIN = re.compile(r"(?i)true|false|yes|no|on|off|null|~|[-+0-9.][0-9._eE+-]*")


def _scalar(value: object, plain: re.Pattern[str] = _PLAIN) -> str:
    """A scalar inline: plain where YAML reads it back as the same string, else double-quoted."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    text = str(value)
    if plain.fullmatch(text) and not _NOT_PLAIN.fullmatch(text) and not text.endswith(" "):
        return text
    return json.dumps(text, ensure_ascii=False)


def render(key: str, value: Any, indent: int) -> list[str]:
    """``key: value`` as YAML lines at ``indent``: mappings in block style, lists of scalars in flow
    style, long text folded (``>-``) to :data:`WIDTH`."""
    pad = " " * indent
    if isinstance(value, Mapping):
        if not value:
            return [f"{pad}{key}: {{}}"]
        return [f"{pad}{key}:", *(line for k, v in value.items() for line in render(k, v, indent + 2))]
    if isinstance(value, list):
        if all(not isinstance(v, Mapping | list) for v in value):
            return [f"{pad}{key}: [{', '.join(_scalar(v, _WORD) for v in value)}]"]
        return [f"{pad}{key}:", *(line for item in value for line in _item(item, indent + 2))]
    inline = f"{pad}{key}: {_scalar(value)}"
    # Text for people (descriptions, messages) is folded rather than quoted.
    prose = key in ("description", "message", "messageExpression") and inline.endswith('"')
    if len(inline) <= WIDTH and not prose:
        return [inline]
    width = WIDTH - indent - 2
    folded = textwrap.wrap(str(value), width, break_long_words=False, break_on_hyphens=False)
    return [f"{pad}{key}: >-", *(f"{pad}  {line}" for line in folded)]


def _item(node: Mapping[str, Any], indent: int) -> list[str]:
    """A mapping as an item of a block list at ``indent`` (``- first: ...``, the rest below it)."""
    lines = [line for k, v in node.items() for line in render(k, v, indent + 2)]
    return [f"{' ' * indent}- {lines[0].lstrip()}", *lines[1:]]
