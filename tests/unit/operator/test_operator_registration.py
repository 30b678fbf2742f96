"""Kopf's handlers are registered by the operator's entry point only, not as a side effect of an import.

Each check runs in a fresh interpreter: this one may have imported the handlers already.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import gpuwarden.operator

HANDLERS_ADDED = """
import importlib, sys
import kopf

def count():
    registry = kopf.get_default_registry()
    # Kopf has no public count of a registry's handlers: one sub-registry per kind of handler.
    kinds = [registry._activities, registry._indexing, registry._watching, registry._spawning,
             registry._changing, registry._webhooks]
    return sum(len(kind.get_all_handlers()) for kind in kinds)

before = count()  # Kopf's own (a login handler, with the kubernetes client installed)
for module in sys.argv[1:]:
    importlib.import_module(module)
print(count() - before)
"""


def handlers_added_by_importing(*modules: str) -> int:
    """How many handlers importing ``modules`` adds to Kopf's default registry."""
    proc = subprocess.run(
        [sys.executable, "-c", HANDLERS_ADDED, *modules], capture_output=True, text=True, check=True
    )
    return int(proc.stdout)


def test_importing_any_operator_module_but_the_handlers_registers_nothing() -> None:
    names = sorted(
        f"gpuwarden.operator.{m.name}"
        for m in pkgutil.iter_modules(gpuwarden.operator.__path__)
        if m.name != "handlers"
    )
    assert "gpuwarden.operator.state" in names
    assert handlers_added_by_importing("gpuwarden.operator", *names) == 0


def test_the_handlers_module_registers_them() -> None:
    # The count above can see registrations: the entry point's import makes them.
    assert handlers_added_by_importing("gpuwarden.operator.handlers") > 0
