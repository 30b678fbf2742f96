"""The operator's fast decoder of a NodeReport: the same schema, checked in one pass by msgspec.

Pydantic stays the schema (the models of :mod:`gpuwarden.wire.node`) and the one voice of every
refusal; this module derives from those models, field by field, msgspec Structs with the same wire
names, types and bounds (strict: JSON types as declared; finite, bounded numbers; nothing unknown;
immutable), and decodes a body into them about four times faster than pydantic validates it
(docs/benchmarks.md, "The ingest path side by side"). A model with checks of its own (validators: a
snapshot's ``services``, the pods' scrapes) is no Struct: its field is kept as raw JSON and pydantic
validates it, as that field, into its models. A body they refuse goes to :func:`parse_report`, which
answers as it always did: its refusal, or its models where it accepts more (snake_case names).

What :func:`decode_report` returns reads like a :class:`~gpuwarden.wire.node.NodeReport`, attribute
for attribute, values equal; it is not a pydantic model (no ``model_*`` methods, no ``isinstance``):
the ingest past the endpoint only reads attributes (tests/unit/wire/test_fast_decode.py).
"""

from __future__ import annotations

import functools
import types
from typing import Annotated, Any, Literal, Union, cast, get_args, get_origin

import annotated_types
import msgspec
from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.fields import FieldInfo

from gpuwarden.wire.node import NodeReport, Snapshot, check_versions, parse_report

__all__ = ["Unmirrored", "decode_report", "mirror"]


def _meta(metadata: list[Any]) -> msgspec.Meta | None:
    """msgspec's constraints for pydantic's (``annotated_types`` bounds and lengths, a pattern)."""
    bounds: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, annotated_types.Ge):
            bounds["ge"] = item.ge
        elif isinstance(item, annotated_types.Le):
            bounds["le"] = item.le
        elif isinstance(item, annotated_types.Gt):
            bounds["gt"] = item.gt
        elif isinstance(item, annotated_types.Lt):
            bounds["lt"] = item.lt
        elif isinstance(item, annotated_types.MinLen):
            bounds["min_length"] = item.min_length
        elif isinstance(item, annotated_types.MaxLen):
            bounds["max_length"] = item.max_length
        elif getattr(item, "pattern", None) is not None:
            # Python's `$` also matches before a final newline; pydantic's (Rust) regex does not.
            pattern: str = item.pattern
            bounds["pattern"] = pattern[:-1] + r"\Z" if pattern.endswith("$") else pattern
        else:
            raise TypeError(f"no msgspec equivalent of {item!r}")
    return msgspec.Meta(**bounds) if bounds else None


def _type(annotation: Any, metadata: list[Any]) -> Any:
    """The msgspec type of a pydantic annotation, ``metadata`` (the field's constraints) applied to
    its value (the non-None part of an optional, as pydantic applies them)."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        own = [m for info in extra if isinstance(info, FieldInfo) for m in info.metadata]
        return _type(inner, [*own, *metadata])
    if origin in (Union, types.UnionType):
        options = get_args(annotation)
        if type(None) not in options or len(options) != 2:
            raise TypeError(f"no msgspec mirror of {annotation!r}")
        (value,) = (o for o in options if o is not type(None))
        return Union[_type(value, metadata), None]  # noqa: UP007 (built at run time)
    if origin is list:
        (item,) = get_args(annotation)
        out: Any = list[_type(item, [])]  # type: ignore[misc]
    elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
        out = mirror(annotation)
    elif origin is Literal and all(type(v) in (str, int) for v in get_args(annotation)):
        out = annotation  # msgspec checks str and int literals as pydantic does (bool is no int here)
    elif annotation in (str, int, float, bool) or (
        isinstance(annotation, type) and issubclass(annotation, str)  # a StrEnum
    ):
        out = annotation
    else:
        raise TypeError(f"no msgspec mirror of {annotation!r}")
    meta = _meta(metadata)
    return Annotated[out, meta] if meta is not None else out


class Unmirrored(TypeError):
    """A model that checks itself (validators): no Struct can say what it refuses."""


@functools.cache
def mirror(model: type[BaseModel]) -> Any:
    """The msgspec Struct of a wire model: its fields by their wire names, types and constraints.

    An optional field holding models that check themselves (:class:`Unmirrored`) is kept as its raw
    JSON (:data:`CHECKED_BY_PYDANTIC` says how to validate it); a required one makes its own model
    :class:`Unmirrored`.
    """
    decorators = model.__pydantic_decorators__
    if decorators.model_validators or decorators.field_validators:
        raise Unmirrored(model.__name__)
    fields = []
    for name, info in model.model_fields.items():
        default: Any = msgspec.NODEFAULT
        if info.default_factory is list:
            default = []  # msgspec copies an empty list default for each Struct
        elif info.default_factory is not None:
            raise TypeError(f"{model.__name__}.{name}: no msgspec mirror of its default_factory")
        elif not info.is_required():
            default = info.default
        raw: TypeAdapter[Any] | None = None
        try:
            kind = _type(info.annotation, info.metadata)
        except Unmirrored:
            if default is not None:
                raise
            kind, raw = msgspec.Raw, TypeAdapter(info.rebuild_annotation())
        fields.append((name, kind, msgspec.field(default=default, name=info.alias or name)))
        if raw is not None:
            CHECKED_BY_PYDANTIC.setdefault(model, []).append((name, raw))
    struct = msgspec.defstruct(
        model.__name__, fields, kw_only=True, forbid_unknown_fields=True, frozen=True, module=__name__
    )
    if model in CHECKED_BY_PYDANTIC:
        CHECKED_BY_PYDANTIC[struct] = CHECKED_BY_PYDANTIC.pop(model)
    return struct


CHECKED_BY_PYDANTIC: dict[type, list[tuple[str, TypeAdapter[Any]]]] = {}
"""The mirror's fields kept raw, by Struct: their names and pydantic's validators (the field's type and
constraints, its models' own checks)."""


@functools.cache
def _decoder() -> tuple[msgspec.json.Decoder[Any], list[tuple[str, TypeAdapter[Any]]]]:
    """The report's decoder, and the snapshot's raw fields (a report keeps them nowhere else)."""
    decoder = msgspec.json.Decoder(mirror(NodeReport))
    raw = CHECKED_BY_PYDANTIC.get(mirror(Snapshot), [])
    if len(CHECKED_BY_PYDANTIC) > (1 if raw else 0):
        raise TypeError(
            f"raw fields outside a snapshot, which decode_report does not read: {CHECKED_BY_PYDANTIC}"
        )
    return decoder, raw


def decode_report(body: bytes) -> NodeReport:
    """:func:`~gpuwarden.wire.node.parse_report`'s answer to ``body``, read-only (see the module doc):
    decoded here when the mirror takes it (a snapshot's raw fields by pydantic), else by
    ``parse_report`` (its ReportError, or its models)."""
    decoder, raw = _decoder()
    try:
        report = cast(NodeReport, decoder.decode(body))
        snapshots: list[Any] = report.snapshots  # the mirror's Structs
        for i, snapshot in enumerate(snapshots):
            for name, adapter in raw:
                value = getattr(snapshot, name)
                if value is not None:  # absent: None, as pydantic's default
                    checked = adapter.validate_json(bytes(value), strict=True)
                    snapshots[i] = snapshot = msgspec.structs.replace(snapshot, **{name: checked})
    except (msgspec.MsgspecError, ValidationError):
        return parse_report(body)
    return check_versions(report)
