"""Reading a policy spec's fields: each check raises :class:`SpecError` with the message users read.

Shared by the spec's parser (:mod:`gpuwarden.policy.parse`) and the rule kinds' own parsers
(:mod:`gpuwarden.policy.rules`): the messages ("must be a duration string such as 5m", "did you mean")
are a product feature, written once here. ``path`` is the API server's notation (``spec.rules[0].x``).
"""

from __future__ import annotations

import difflib
import enum
import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any, TypeVar

from gpuwarden.units import format_duration, parse_duration

__all__ = [
    "SpecError",
    "as_list",
    "as_object",
    "boolean",
    "check_fields",
    "did_you_mean",
    "duration",
    "integer",
    "member",
    "number",
    "optional_number",
    "show",
    "string",
    "type_name",
    "value_or",
]

_T = TypeVar("_T")
_E = TypeVar("_E", bound=enum.Enum)


class SpecError(ValueError):
    """A policy the API would reject, or that cannot be evaluated; ``field`` is the path of the culprit."""

    def __init__(self, field: str, reason: str, *, source: str | None = None) -> None:
        self.field = field
        self.reason = reason
        self.source = source
        super().__init__(str(self))

    def __str__(self) -> str:
        text = f"{self.field}: {self.reason}" if self.field else self.reason
        return f"{self.source}: {text}" if self.source else text


def as_object(value: Any, path: str) -> Mapping[str, Any]:
    """``value`` as an object with string keys."""
    if not isinstance(value, Mapping):
        raise SpecError(path, f"must be an object, not {type_name(value)}")
    for key in value:
        if not isinstance(key, str):
            raise SpecError(path, f"field names must be strings, not {type_name(key)} {key!r}")
    return value


def as_list(value: Any, path: str, *, max_items: int) -> Sequence[Any]:
    """``value`` as a list of at most ``max_items``."""
    if not isinstance(value, list | tuple):
        raise SpecError(path, f"must be a list, not {type_name(value)}")
    if len(value) > max_items:
        raise SpecError(path, f"has {len(value)} items; at most {max_items} are allowed")
    return value


def check_fields(
    obj: Mapping[str, Any], path: str, allowed: Collection[str], required: Collection[str] = ()
) -> None:
    """Unknown fields are errors (the API server would prune them silently: a typo would go unnoticed)."""
    for key in obj:
        if key not in allowed:
            field = f"{path}.{key}" if path else key
            hint = did_you_mean(key, allowed) or f" (expected one of: {', '.join(sorted(allowed))})"
            raise SpecError(field, f"unknown field{hint}")
    for key in required:
        if obj.get(key) is None:
            raise SpecError(f"{path}.{key}" if path else key, "required field is missing")


def did_you_mean(word: str, choices: Collection[str]) -> str:
    """`` (did you mean "x"?)`` for the closest of ``choices``; empty when none is close."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.75)
    return f' (did you mean "{close[0]}"?)' if close else ""


def member(kind: type[_E], raw: Any, field: str) -> _E:
    """``raw`` as a member of the string enum ``kind``, or the error that lists its values."""
    try:
        return kind(raw)
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise SpecError(field, f"{show(raw)} is not one of {choices}") from None


def value_or(obj: Mapping[str, Any], key: str, default: _T) -> Any | _T:
    """A field's value; absent and null (which the API server prunes before defaulting) read as default."""
    value = obj.get(key)
    return default if value is None else value


def number(obj: Mapping[str, Any], key: str, path: str, default: float | None, lo: float, hi: float) -> float:
    """A number field in ``[lo, hi]``; ``default`` when absent (None: the field is required)."""
    value = optional_number(obj, key, path, lo, hi)
    if value is not None:
        return value
    if default is None:
        raise SpecError(f"{path}.{key}", "required field is missing")
    return default


def optional_number(obj: Mapping[str, Any], key: str, path: str, lo: float, hi: float | None) -> float | None:
    """A number field in ``[lo, hi]`` (``hi`` None: no upper bound), or None when absent."""
    raw = obj.get(key)
    if raw is None:
        return None
    field = f"{path}.{key}"
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise SpecError(field, f"must be a number, not {type_name(raw)}")
    value = float(raw)
    if not math.isfinite(value):
        raise SpecError(field, f"must be a finite number, not {raw}")
    if value < lo or (hi is not None and value > hi):
        bounds = f"between {lo:g} and {hi:g}" if hi is not None else f"at least {lo:g}"
        raise SpecError(field, f"{raw} is out of range; must be {bounds}")
    return value


def integer(obj: Mapping[str, Any], key: str, path: str, default: int | None, lo: int, hi: int) -> int:
    """An integer field in ``[lo, hi]``; ``default`` when absent (None: the field is required)."""
    raw = obj.get(key)
    field = f"{path}.{key}"
    if raw is None:
        if default is None:
            raise SpecError(field, "required field is missing")
        return default
    # JSON has one number type; the API server accepts 3.0 for an integer field, so we do too.
    if isinstance(raw, float) and raw.is_integer():
        raw = int(raw)
    if isinstance(raw, bool) or not isinstance(raw, int):
        raise SpecError(field, f"must be an integer, not {type_name(raw)}")
    if not lo <= raw <= hi:
        raise SpecError(field, f"{raw} is out of range; must be between {lo} and {hi}")
    return raw


def boolean(obj: Mapping[str, Any], key: str, path: str, default: bool) -> bool:
    """A boolean field, ``default`` when absent."""
    raw = value_or(obj, key, default)
    if not isinstance(raw, bool):
        raise SpecError(f"{path}.{key}", f"must be true or false, not {type_name(raw)}")
    return raw


def string(obj: Mapping[str, Any], key: str, path: str, *, max_length: int) -> str:
    """A required non-empty string field of at most ``max_length`` characters."""
    raw = obj.get(key)
    field = f"{path}.{key}"
    if not isinstance(raw, str):
        raise SpecError(field, f"must be a string, not {type_name(raw)}")
    if not raw:
        raise SpecError(field, "must not be empty")
    if len(raw) > max_length:
        raise SpecError(field, f"is {len(raw)} characters long; at most {max_length} are allowed")
    return raw


def duration(obj: Mapping[str, Any], key: str, path: str, default: str, *, minimum: float = 0.0) -> float:
    """A duration field (``5m``, ``1h30m``) in seconds, ``default`` when absent, at least ``minimum``."""
    raw = value_or(obj, key, default)
    field = f"{path}.{key}"
    if not isinstance(raw, str):
        # YAML reads `for: 300` as a number: say what is wrong rather than guess seconds.
        raise SpecError(field, f"must be a duration string such as 5m or 1h30m, not {type_name(raw)} {raw!r}")
    try:
        seconds = parse_duration(raw)
    except ValueError as exc:
        raise SpecError(field, str(exc)) from None
    if seconds < minimum:
        raise SpecError(field, f'"{raw}" is too short; must be at least {format_duration(minimum)}')
    return seconds


def type_name(value: Any) -> str:
    """How a JSON/YAML value's type reads in a message."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, Mapping):
        return "an object"
    if isinstance(value, list | tuple):
        return "a list"
    return type(value).__name__


def show(value: Any) -> str:
    """A value as a message quotes it: a string in double quotes, anything else as Python writes it."""
    return f'"{value}"' if isinstance(value, str) else repr(value)
