"""Fields of the policy's spec, declared once: their names, types, bounds, defaults and descriptions.

A rule kind's module declares its body as a :class:`Body` of these next to its parser, and
:mod:`gpuwarden.policy.spec.declarations` the spec's own fields. The parser reads each field through
its declaration (:meth:`Field.read`, :meth:`Field.get`), and the CRD's schema is rendered from the
same declarations (:meth:`Field.openapi`, by :mod:`gpuwarden.policy.crd` and ``make crds``), so a
bound or a default is written in one place and the two cannot disagree
(``tests/unit/test_crd_schema.py`` regenerates the CRD and compares).

A field's description is what ``kubectl explain`` prints; its default is appended to it
(``Default: 5m.``), because ``kubectl explain`` prints descriptions, never defaults. What a CEL rule
checks across fields (:class:`Check`) is the one thing written twice: CEL for the API server, Python
in the parser for local mode's files, side by side.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypeVar, cast

from gpuwarden.policy.spec.fields import (
    SpecError,
    as_object,
    boolean,
    check_fields,
    duration,
    integer,
    member,
    optional_number,
    show,
    type_name,
)
from gpuwarden.units import DURATION_PATTERN, RATE_PATTERN, parse_duration, parse_quantity, parse_rate

__all__ = [
    "DURATION_MESSAGE",
    "Body",
    "Boolean",
    "Bytes",
    "Check",
    "Choice",
    "Duration",
    "Field",
    "IntOrPercent",
    "Integer",
    "ListOf",
    "Names",
    "Node",
    "Number",
    "Object",
    "Rate",
    "Text",
]

Node = dict[str, Any]
"""A node of the CRD's openAPIV3Schema, as YAML reads it."""

DURATION_MESSAGE = "must be a duration such as 5m or 1h30m (units h, m, s, ms)"
MAX_DURATION_LENGTH = 32
"""Every string CEL reads carries maxLength, so that the API server's cost estimate stays small."""

_T = TypeVar("_T")
_E = TypeVar("_E", bound=enum.Enum)


@dataclass(frozen=True, slots=True)
class Check:
    """A CEL rule of the CRD's (an ``x-kubernetes-validations`` entry); the kind's parser enforces the
    same in Python beside it (local mode's files meet no API server)."""

    rule: str
    message: str
    field_path: str | None = None

    def openapi(self) -> Node:
        node: Node = {"rule": self.rule, "message": self.message}
        if self.field_path is not None:
            node["fieldPath"] = self.field_path
        return node


def _yaml_word(value: object) -> str:
    """A default as the description says it: YAML's spelling (``true``, not ``True``)."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value)


@dataclass(frozen=True, slots=True)
class Field(Generic[_T]):
    """One field of a body: its name (its key), and what ``kubectl explain`` says of it."""

    name: str
    description: str

    @property
    def required(self) -> bool:
        """Whether the schema lists it as required (absent: ``required field is missing``)."""
        return False

    @property
    def default(self) -> Any:
        """The CRD's default, as YAML writes it; None: none."""
        return None

    def explain(self) -> str:
        """The description as the CRD carries it: with its default, if it has one."""
        if self.default is None:
            return self.description
        return f"{self.description} Default: {_yaml_word(self.default)}."

    def openapi(self) -> Node:
        raise NotImplementedError

    def get(self, obj: Mapping[str, Any], path: str) -> _T | None:
        """The field's value, checked; None when absent (or null), its default not applied.

        Not for :class:`Text`, :class:`Names` and :class:`ListOf`: their parsers read them with the
        declared bounds and their own words (which name the grammar: "not a kind such as Deployment")."""
        raise NotImplementedError

    def read(self, obj: Mapping[str, Any], path: str) -> _T:
        """The field's value, checked; its default when absent; an error when absent without one."""
        value = self.get(obj, path)
        if value is None:
            if self.default is None:
                raise SpecError(f"{path}.{self.name}", "required field is missing")
            value = self.get({self.name: self.default}, path)  # a default is a valid value
        return cast(_T, value)


@dataclass(frozen=True, slots=True)
class Number(Field[float]):
    """A number in ``[minimum, maximum]`` (no maximum: unbounded above)."""

    _: KW_ONLY
    minimum: float
    maximum: float | None = None
    above: bool = False
    """The minimum itself is refused (a CEL rule: the API server's exclusiveMinimum reads worse)."""
    default: float | None = None
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "number", "description": self.explain()}
        if self.default is not None:
            node["default"] = self.default
        node["minimum"] = self.minimum
        if self.maximum is not None:
            node["maximum"] = self.maximum
        if self.above:
            node["x-kubernetes-validations"] = [
                Check(
                    f"self > {float(self.minimum)!r}", f"{self.name} must be above {self.minimum:g}"
                ).openapi()
            ]
        return node

    def get(self, obj: Mapping[str, Any], path: str) -> float | None:
        value = optional_number(obj, self.name, path, self.minimum, self.maximum)
        if self.above and value == self.minimum:
            raise SpecError(f"{path}.{self.name}", f"must be above {self.minimum:g}")
        return value


@dataclass(frozen=True, slots=True)
class Integer(Field[int]):
    """An integer in ``[minimum, maximum]``, or one of ``choices``."""

    _: KW_ONLY
    minimum: int | None = None
    maximum: int | None = None
    """None: the greatest of ``choices``, else an int32's (the parser's bound; the schema says int32
    when ``int32`` is set, as for a Kubernetes replica count)."""
    int32: bool = False
    choices: tuple[int, ...] = ()
    default: int | None = None
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "integer"}
        if self.int32:
            node["format"] = "int32"
        node["description"] = self.explain()
        if self.choices:
            node["enum"] = list(self.choices)
        if self.default is not None:
            node["default"] = self.default
        if self.minimum is not None:
            node["minimum"] = self.minimum
        if self.maximum is not None:
            node["maximum"] = self.maximum
        return node

    @property
    def bounds(self) -> tuple[int, int]:
        """Its least and greatest value."""
        lo = self.minimum if self.minimum is not None else min(self.choices)
        hi = self.maximum if self.maximum is not None else max(self.choices, default=2**31 - 1)
        return lo, hi

    def get(self, obj: Mapping[str, Any], path: str) -> int | None:
        if obj.get(self.name) is None:
            return None
        value = integer(obj, self.name, path, None, *self.bounds)
        if self.choices and value not in self.choices:
            raise SpecError(
                f"{path}.{self.name}", f"{value} is not one of {', '.join(map(str, self.choices))}"
            )
        return value


@dataclass(frozen=True, slots=True)
class Boolean(Field[bool]):
    """true or false."""

    _: KW_ONLY
    default: bool | None = None

    def openapi(self) -> Node:
        node: Node = {"type": "boolean", "description": self.explain()}
        if self.default is not None:
            node["default"] = self.default
        return node

    def get(self, obj: Mapping[str, Any], path: str) -> bool | None:
        return None if obj.get(self.name) is None else boolean(obj, self.name, path, False)


@dataclass(frozen=True, slots=True)
class Choice(Field[_E]):
    """One of a string enum's values."""

    _: KW_ONLY
    choices: type[_E]
    default: _E | None = None
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "string", "description": self.explain()}
        node["enum"] = [m.value for m in self.choices]
        if self.default is not None:
            node["default"] = self.default.value
        return node

    def check(self, raw: Any, field: str) -> _E:
        """``raw`` (a field's or a list item's value) as one of the choices."""
        return member(self.choices, raw, field)

    def get(self, obj: Mapping[str, Any], path: str) -> _E | None:
        raw = obj.get(self.name)
        return None if raw is None else self.check(raw, f"{path}.{self.name}")


@dataclass(frozen=True, slots=True)
class Duration(Field[float]):
    """A Gateway API duration (``5m``, ``1h30m``), read in seconds, at least ``minimum``.

    ``window``: it is the rule's window, which must span an evaluation interval (a CEL rule on the
    spec, and the parser, check it).
    """

    _: KW_ONLY
    default: str | None = None
    minimum: str | None = None
    maximum: str | None = None
    required: bool = False
    window: bool = False
    label: str | None = None
    """How its bound's message names it; None: by its name."""

    def openapi(self) -> Node:
        node: Node = {"type": "string", "description": self.explain()}
        if self.default is not None:
            node["default"] = self.default
        node["maxLength"] = MAX_DURATION_LENGTH
        checks = [Check(f"self.matches('{DURATION_PATTERN}')", DURATION_MESSAGE)]
        label = self.label or self.name
        # A bound must not also fail (unreadably) on a malformed duration.
        valid = f"!self.matches('{DURATION_PATTERN}')"
        if self.minimum is not None and self.maximum is not None:
            checks.append(
                Check(
                    f"{valid} || (duration(self) >= duration('{self.minimum}')"
                    f" && duration(self) <= duration('{self.maximum}'))",
                    f"{label} must be between {self.minimum} and {self.maximum}",
                )
            )
        elif self.minimum is not None:
            checks.append(
                Check(
                    f"{valid} || duration(self) >= duration('{self.minimum}')",
                    f"{label} must be at least {self.minimum}",
                )
            )
        node["x-kubernetes-validations"] = [c.openapi() for c in checks]
        return node

    def get(self, obj: Mapping[str, Any], path: str) -> float | None:
        if obj.get(self.name) is None:
            return None
        least = 0.0 if self.minimum is None else parse_duration(self.minimum)
        seconds = duration(obj, self.name, path, "0s", minimum=least)
        if self.maximum is not None and seconds > parse_duration(self.maximum):
            raise SpecError(f"{path}.{self.name}", f"must be at most {self.maximum}")
        return seconds


@dataclass(frozen=True, slots=True)
class Text(Field[str]):
    """A string of ``min_length`` to ``max_length`` characters matching ``pattern`` (a regular
    expression both CEL and Python read alike; unanchored: the whole string must match).

    With a ``message``, a CEL rule checks the pattern and says that message; without, the schema's
    ``pattern`` does (whose message is the regex: only for Kubernetes' own names, whose grammar is the
    API's).
    """

    _: KW_ONLY
    min_length: int | None = 1
    """None: the schema says nothing (the parser still refuses an empty string)."""
    max_length: int
    pattern: str | None = None
    message: str | None = None
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "string", "description": self.explain()}
        if self.min_length is not None:
            node["minLength"] = self.min_length
        node["maxLength"] = self.max_length
        if self.pattern is not None and self.message is None:
            node["pattern"] = f"^{self.pattern}$"
        elif self.pattern is not None and self.message is not None:
            literal = self.pattern.replace("\\", "\\\\").replace("'", "\\'")  # in CEL's '...'
            check = Check(f"self.matches('^{literal}$')", self.message)
            node["x-kubernetes-validations"] = [check.openapi()]
        return node

    def matches(self, raw: str) -> bool:
        """Whether ``raw`` is a valid value (length and pattern)."""
        if not max(self.min_length or 0, 1) <= len(raw) <= self.max_length:
            return False
        return self.pattern is None or bool(re.fullmatch(self.pattern, raw))


@dataclass(frozen=True, slots=True)
class Rate(Field[float]):
    """A byte rate (``100Mi/m``), read in bytes a second, above zero."""

    _: KW_ONLY
    required: bool = False

    def openapi(self) -> Node:
        return {
            "type": "string",
            "description": self.explain(),
            "maxLength": MAX_DURATION_LENGTH,
            "x-kubernetes-validations": [
                Check(
                    f"self.matches('{RATE_PATTERN}')",
                    "must be a rate such as 100Mi/m, 2Gi/h or 500k/s: a byte quantity (suffixes Ki Mi Gi"
                    " Ti Pi, k M G T P) per s, m or h",
                ).openapi(),
                Check(
                    f"!self.matches('{RATE_PATTERN}') || !self.matches('^[0.]+[A-Za-z]*/')",
                    "rate must be greater than zero",
                ).openapi(),
            ],
        }

    def get(self, obj: Mapping[str, Any], path: str) -> float | None:
        raw = obj.get(self.name)
        if raw is None:
            return None
        field = f"{path}.{self.name}"
        if not isinstance(raw, str):
            raise SpecError(field, f"must be a quantity per time unit such as 100Mi/m, not {type_name(raw)}")
        try:
            return parse_rate(raw)
        except ValueError as exc:
            raise SpecError(field, str(exc)) from None


@dataclass(frozen=True, slots=True)
class Bytes(Field[int]):
    """A size in bytes above zero: an integer, or a Kubernetes quantity (``120Gi``)."""

    _: KW_ONLY
    required: bool = False

    def explain(self) -> str:
        # kubectl explain types an int-or-string field <Object>: the description says what it is.
        return f"Integer or string: {self.description}"

    def openapi(self) -> Node:
        return {
            "description": self.explain(),
            "x-kubernetes-int-or-string": True,
            "maxLength": 64,
            "x-kubernetes-validations": [
                Check(
                    "type(self) == int ? self > 0 : (isQuantity(self) && quantity(self).isInteger()"
                    " && quantity(self).asInteger() > 0)",
                    "must be a whole number of bytes greater than zero: an integer, or a quantity such as"
                    " 120Gi, 80G or 1.5Ti",
                ).openapi()
            ],
        }

    def get(self, obj: Mapping[str, Any], path: str) -> int | None:
        raw = obj.get(self.name)
        if raw is None:
            return None
        field = f"{path}.{self.name}"
        if isinstance(raw, bool) or not isinstance(raw, str | int):
            raise SpecError(field, f"must be a quantity such as 120Gi, not {type_name(raw)}")
        try:
            size = parse_quantity(raw)
        except ValueError as exc:
            raise SpecError(field, str(exc)) from None
        if size == 0:
            raise SpecError(field, "must be greater than zero")
        return size


@dataclass(frozen=True, slots=True)
class ListOf(Field[tuple[Any, ...]]):
    """A set (no duplicates) of at most ``max_items`` values, each as ``item`` declares (its name unused)."""

    _: KW_ONLY
    item: Integer | Choice[Any]
    max_items: int

    def openapi(self) -> Node:
        item = self.item.openapi()
        return {
            "type": "array",
            "description": self.explain(),
            "maxItems": self.max_items,
            "x-kubernetes-list-type": "set",
            "items": item,
        }


@dataclass(frozen=True, slots=True)
class IntOrPercent(Field[tuple[int | None, float | None]]):
    """A count of at least 1, or a percentage string (``50%``) matching ``percent``: read as
    ``(count, None)`` or ``(None, percent)``."""

    _: KW_ONLY
    default: int
    percent: str
    """The percentage's grammar (unanchored), e.g. ``[1-9][0-9]{0,2}%``."""
    span: str
    """The percentages it allows, in words: ``1% to 999%``."""

    def explain(self) -> str:
        # kubectl explain types an int-or-string field <Object>: the description says what it is.
        return f"Integer or string: {Field.explain(self)}"

    def openapi(self) -> Node:
        return {
            "description": self.explain(),
            "x-kubernetes-int-or-string": True,
            "default": self.default,
            "minimum": 1,
            "maxLength": 4,
            "x-kubernetes-validations": [
                Check(
                    f"type(self) == int || self.matches('^{self.percent}$')",
                    f"must be a count such as 1 or a percentage from {self.span}",
                ).openapi()
            ],
        }

    def get(self, obj: Mapping[str, Any], path: str) -> tuple[int | None, float | None] | None:
        raw = obj.get(self.name)
        if raw is None:
            return None
        if isinstance(raw, str):
            if not re.fullmatch(self.percent, raw):
                raise SpecError(
                    f"{path}.{self.name}",
                    f"{show(raw)} is not a count such as 1 or a percentage from {self.span}",
                )
            return None, float(raw[:-1])
        return integer(obj, self.name, path, None, 1, 2**31 - 1), None


@dataclass(frozen=True, slots=True)
class Names(Field[tuple[str, ...]]):
    """A set of rule names (the parser checks that each is a rule of the spec's)."""

    _: KW_ONLY
    item: str
    """The description of one name."""
    min_items: int = 0
    max_items: int
    max_length: int
    defaulted: bool = False
    """The schema defaults it to ``[]``."""
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "array", "description": self.explain()}
        if self.min_items:
            node["minItems"] = self.min_items
        node["maxItems"] = self.max_items
        node["x-kubernetes-list-type"] = "set"
        if self.defaulted:
            node["default"] = []
        node["items"] = {"type": "string", "description": self.item, "maxLength": self.max_length}
        return node


@dataclass(frozen=True, slots=True)
class Object(Field[Mapping[str, Any]]):
    """An object of declared fields, read as itself (checked for unknown and missing fields): its
    parser reads its fields through their declarations."""

    _: KW_ONLY
    fields: tuple[Field[Any], ...]
    checks: tuple[Check, ...] = ()
    defaulted: bool = False
    """The schema defaults it to ``{}`` (so that its fields' defaults apply): read as ``{}`` when absent."""
    required: bool = False

    @property
    def body(self) -> Body:
        return Body(self.description, self.fields, self.checks)

    def openapi(self) -> Node:
        node = self.body.openapi()
        if self.defaulted:
            node = {"type": "object", "description": self.description, "default": {}} | node
        return node

    def get(self, obj: Mapping[str, Any], path: str) -> Mapping[str, Any] | None:
        raw = obj.get(self.name)
        if raw is None:
            return {} if self.defaulted else None
        field = f"{path}.{self.name}"
        value = as_object(raw, field)
        self.body.check(value, field)
        return value

    def field(self, name: str) -> Field[Any]:
        """One of its fields, by name."""
        return next(f for f in self.fields if f.name == name)


@dataclass(frozen=True, slots=True)
class Body:
    """A rule kind's body under ``spec.rules[]``: its fields, and the CEL rules across them."""

    description: str
    fields: tuple[Field[Any], ...]
    checks: tuple[Check, ...] = ()

    def check(self, obj: Mapping[str, Any], path: str) -> None:
        """No unknown field, every required one present (the fields' own checks are their reads')."""
        check_fields(obj, path, [f.name for f in self.fields], [f.name for f in self.fields if f.required])

    @property
    def defaults(self) -> Mapping[str, Any]:
        """The CRD's defaults of its fields, by name, as YAML writes them."""
        return {f.name: _plain(f.default) for f in self.fields if f.default is not None}

    @property
    def window(self) -> str | None:
        """The field that is its window (which must span an evaluation interval); None: it reads none."""
        return next((f.name for f in self.fields if isinstance(f, Duration) and f.window), None)

    def openapi(self) -> Node:
        node: Node = {"type": "object", "description": self.description}
        required = [f.name for f in self.fields if f.required]
        if required:
            node["required"] = required
        if self.checks:
            node["x-kubernetes-validations"] = [c.openapi() for c in self.checks]
        node["properties"] = {f.name: f.openapi() for f in self.fields}
        return node


def _plain(value: object) -> object:
    """A default as YAML reads it (an enum member as its string)."""
    return value.value if isinstance(value, enum.Enum) else value
