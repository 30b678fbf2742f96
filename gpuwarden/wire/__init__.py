"""gpuwarden.wire: the versioned contracts between gpuwarden's processes, validated on both ends.

Import a schema from its own module, the package's public surface:

- :mod:`gpuwarden.wire.node`: the NodeReport an agent sends the operator (``parse_report``,
  ``dump_report``), its samples, and the helpers on them (``device_key``,
  ``merge_process_utilization``);
- :mod:`gpuwarden.wire.fast`: the operator's decoder of a NodeReport (``decode_report``): msgspec
  Structs derived from ``node``'s models, pydantic answering what they refuse;
- :mod:`gpuwarden.wire.scrape`: the pods' own metrics: the scrape plan the operator answers a
  report with (``parse_plan``, ``dump_plan``), and the compacted scrapes a snapshot carries back;
- :mod:`gpuwarden.wire.verdicts`: the VerdictReport a shard sends a policy's owner;
- :mod:`gpuwarden.wire.hook`: the line a training hook writes to the agent (``parse_message``);
- :mod:`gpuwarden.wire.base`: what they share: ``WireModel``, the common bounds, and
  ``parse_strict`` and ``first_error``, the field-naming message of a refused document.

This ``__init__`` imports none of them: each process loads only the schemas it speaks (the
models cost memory as they are built, docs/benchmarks.md; an agent never loads the verdicts).
``gpuwarden.wire`` imports nothing else of gpuwarden's (an import contract in pyproject.toml).
"""

__all__ = ["base", "fast", "hook", "node", "scrape", "verdicts"]
