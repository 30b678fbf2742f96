"""What decoding one node report costs, decoder by decoder, on bench/ingest.py's body (8 GPUs, health).

Not a test: a benchmark, recorded in docs/benchmarks.md ("The ingest path side by side"). CPU µs a
report, best of ``--repeat`` passes over ``--nodes`` bodies:

- ``json.loads``: the JSON alone, no schema (the floor of any decoder);
- ``parse_report``: pydantic, as the operator parsed every report before issue 42 (and still answers
  what the mirror refuses);
- ``model_validate_json`` and a ``TypeAdapter``: pydantic's own fast paths, strict;
- ``decode_report``: the ingest's decoder now (msgspec Structs mirrored from the models);
- ``decode_report + model_construct``: the same, then the pydantic models built from it in Python
  (what keeping pydantic objects past the endpoint would cost).

    .venv/bin/python bench/wire_decode.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
from pydantic import BaseModel, TypeAdapter

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ingest import Bodies, Layout

from gpuwarden.wire import node
from gpuwarden.wire.base import WireModel
from gpuwarden.wire.fast import Unmirrored, decode_report, mirror
from gpuwarden.wire.node import NodeReport, parse_report


def constructed(value: Any, models: dict[type, type[BaseModel]]) -> Any:
    """The pydantic models of a mirror's Structs, built without validation (``model_construct``)."""
    if isinstance(value, list):
        return [constructed(v, models) for v in value]
    model = models.get(type(value))
    if model is None:
        return value
    fields = value.__struct_fields__
    return model.model_construct(**{f: constructed(getattr(value, f), models) for f in fields})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    bodies = Bodies(Layout(args.nodes, 100))
    now = time.time()
    texts = [bodies(n, 1, now) for n in range(args.nodes)]
    adapter, validate = TypeAdapter(NodeReport), NodeReport.model_validate_json
    models: dict[type, type[BaseModel]] = {}
    for name in dir(node):
        model = getattr(node, name)
        if isinstance(model, type) and issubclass(model, WireModel) and model is not WireModel:
            with contextlib.suppress(Unmirrored):  # a model that checks itself: none in the bench's body
                models[mirror(model)] = model
    decoders: dict[str, Callable[[bytes], Any]] = {
        "json.loads": json.loads,
        "parse_report (pydantic)": parse_report,
        "NodeReport.model_validate_json(strict=True)": lambda b: validate(b, strict=True),
        "TypeAdapter(NodeReport).validate_json(strict=True)": lambda b: adapter.validate_json(b, strict=True),
        "decode_report (msgspec mirror)": decode_report,
        "decode_report + model_construct": lambda b: constructed(decode_report(b), models),
    }
    assert isinstance(decode_report(texts[0]), msgspec.Struct)
    print(f"{len(texts[0]):,} bytes a body; CPU µs a report, best of {args.repeat} passes over {len(texts)}")
    for name, decode in decoders.items():
        runs = []
        for _ in range(args.repeat):
            started = time.process_time()
            for text in texts:
                decode(text)
            runs.append(time.process_time() - started)
        print(f"{1e6 * min(runs) / len(texts):8.1f}  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
