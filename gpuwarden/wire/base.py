"""What the wire schemas share: the model base, the bounds every schema uses, the error message.

Every schema parses strictly and bounds every number, so that no value of a valid message can
overflow a conversion further down (float(), Prometheus' text format); the bounds two schemas
share are here, each schema's own beside its models.
"""

from __future__ import annotations

from typing import Annotated, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

__all__ = ["MAX_BYTES", "MAX_COUNT", "MAX_TIMESTAMP", "Bytes", "WireModel", "first_error", "parse_strict"]

MAX_BYTES = 2**50
"""Memory readings above a pebibyte are no reading (an H200 has 141 GB; a node a few TiB)."""
MAX_COUNT = 2**53
"""Counters and sequence numbers: every one below this is exact as a float64 too."""
MAX_TIMESTAMP = 2.0**53
"""Seconds since the epoch: absurd, but in milliseconds it still fits an int64 (Prometheus' timestamps)."""

Bytes = Annotated[int, Field(ge=0, le=MAX_BYTES)]


class WireModel(BaseModel):
    """Base for wire models: camelCase on the wire, snake_case in Python, nothing unknown, immutable."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        validate_by_name=True,
        extra="forbid",
        frozen=True,
        # NaN and infinities are no readings: None says "not read"; built or parsed, they are refused.
        allow_inf_nan=False,
    )


def first_error(exc: ValidationError, *, top: str = "body") -> str:
    """``field.path: what is wrong (and N more)``: the first of pydantic's errors, naming the field
    (``top`` when it is the whole document); the wire parsers' messages."""
    first = exc.errors(include_url=False)[0]
    where = ".".join(str(p) for p in first["loc"]) or top
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{where}: {first['msg']}{more}"


Model = TypeVar("Model", bound=WireModel)


def parse_strict(
    model: type[Model],
    body: bytes | str,
    error: type[ValueError],
    *,
    top: str = "body",
    by_name: bool | None = None,
) -> Model:
    """Validate a JSON document strictly (JSON types as declared, no coercion); raise ``error``
    with :func:`first_error`'s message. ``by_name=False`` refuses snake_case spellings, nested
    models' included (the model's own config reaches only its own fields)."""
    try:
        return model.model_validate_json(body, strict=True, by_name=by_name)
    except ValidationError as exc:
        raise error(first_error(exc, top=top)) from None
