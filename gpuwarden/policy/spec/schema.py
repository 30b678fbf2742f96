"""A rule kind's fields, declared once: their names, types, bounds, defaults and descriptions.

A kind's module declares its body as a :class:`Body` of these next to its parser. The parser reads
each field through its declaration (:meth:`Field.read`, :meth:`Field.get`), and the CRD's schema for
the kind is rendered from the same declaration (:meth:`Body.openapi`, by
:mod:`gpuwarden.policy.crd` and ``make crds``), so a bound or a default is written in one place and
the two cannot disagree (``tests/unit/test_crd_schema.py`` regenerates the CRD and compares).

A field's description is what ``kubectl explain`` prints; its default is appended to it
(``Default: 5m.``), because ``kubectl explain`` prints descriptions, never defaults. What a CEL rule
checks across fields (:class:`Check`) is the one thing written twice: CEL for the API server, Python
in the kind's parser for local mode's files, side by side in the kind's module.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any, Generic, TypeVar, cast

from gpuwarden.policy.spec.fields import (
    SpecError,
    boolean,
    check_fields,
    duration,
    integer,
    member,
    optional_number,
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
    "Integer",
    "ListOf",
    "Node",
    "Number",
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


def _cel_duration(name: str, minimum: str) -> Check:
    """A duration's lower bound, which must not also fail (unreadably) on a malformed duration."""
    return Check(
        f"!self.matches('{DURATION_PATTERN}') || duration(self) >= duration('{minimum}')",
        f"{name} must be at least {minimum}",
    )


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
        """The field's value, checked; None when absent (or null), its default not applied."""
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
    default: float | None = None
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "number", "description": self.explain()}
        if self.default is not None:
            node["default"] = self.default
        node["minimum"] = self.minimum
        if self.maximum is not None:
            node["maximum"] = self.maximum
        return node

    def get(self, obj: Mapping[str, Any], path: str) -> float | None:
        return optional_number(obj, self.name, path, self.minimum, self.maximum)


@dataclass(frozen=True, slots=True)
class Integer(Field[int]):
    """An integer in ``[minimum, maximum]``, or one of ``choices``."""

    _: KW_ONLY
    minimum: int | None = None
    maximum: int | None = None
    choices: tuple[int, ...] = ()
    default: int | None = None
    required: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "integer", "description": self.explain()}
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
        hi = self.maximum if self.maximum is not None else max(self.choices)
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
    required: bool = False
    window: bool = False

    def openapi(self) -> Node:
        node: Node = {"type": "string", "description": self.explain()}
        if self.default is not None:
            node["default"] = self.default
        node["maxLength"] = MAX_DURATION_LENGTH
        checks = [Check(f"self.matches('{DURATION_PATTERN}')", DURATION_MESSAGE)]
        if self.minimum is not None:
            checks.append(_cel_duration(self.name, self.minimum))
        node["x-kubernetes-validations"] = [c.openapi() for c in checks]
        return node

    def get(self, obj: Mapping[str, Any], path: str) -> float | None:
        if obj.get(self.name) is None:
            return None
        least = 0.0 if self.minimum is None else parse_duration(self.minimum)
        return duration(obj, self.name, path, "0s", minimum=least)


@dataclass(frozen=True, slots=True)
class Text(Field[str]):
    """A string of ``min_length`` to ``max_length`` characters matching ``pattern`` (a regular
    expression both CEL and Python read alike; unanchored: the whole string must match)."""

    _: KW_ONLY
    min_length: int = 1
    max_length: int
    pattern: str
    message: str
    """The CEL rule's message when the pattern does not match."""
    required: bool = False

    def openapi(self) -> Node:
        return {
            "type": "string",
            "description": self.explain(),
            "minLength": self.min_length,
            "maxLength": self.max_length,
            "x-kubernetes-validations": [Check(f"self.matches('^{self.pattern}$')", self.message).openapi()],
        }

    def matches(self, raw: str) -> bool:
        """Whether ``raw`` is a valid value (length and pattern)."""
        return self.min_length <= len(raw) <= self.max_length and bool(re.fullmatch(self.pattern, raw))


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
