"""Kopf's handlers go into the operator's own registry, never into Kopf's default one, so that importing
the operator has no effect on Kopf; only :mod:`gpuwarden.operator.kopfrun` (for ``kopf run -m``) makes
the operator's registry Kopf's default.

The runtime checks run in a fresh interpreter: this one may have imported the shim already.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import gpuwarden.operator

OPERATOR = Path(gpuwarden.operator.__file__).parent

DEFAULT_AFTER_IMPORTS = """
import importlib, sys
import kopf

default = kopf.get_default_registry()
for module in sys.argv[1:]:
    importlib.import_module(module)
from gpuwarden.operator.handlers import registry

now = kopf.get_default_registry()
print("kopf's" if now is default else "the operator's" if now is registry else "another")
"""


def default_registry_after_importing(*modules: str) -> str:
    """Whose registry is Kopf's default after importing ``modules`` in a fresh interpreter."""
    proc = subprocess.run(
        [sys.executable, "-c", DEFAULT_AFTER_IMPORTS, *modules], capture_output=True, text=True, check=True
    )
    return proc.stdout.strip()


def operator_modules() -> list[str]:
    return sorted(
        m.name for m in pkgutil.walk_packages(gpuwarden.operator.__path__, prefix="gpuwarden.operator.")
    )


def kopf_decorators(tree: ast.AST) -> list[ast.Call]:
    """The ``@kopf....(...)`` decorators of a module's functions."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for decorator in node.decorator_list:
                if isinstance(decorator, ast.Call) and ast.unparse(decorator.func).startswith("kopf."):
                    found.append(decorator)
    return found


def test_every_kopf_handler_of_the_operator_goes_into_its_registry() -> None:
    decorators = [
        (path.relative_to(OPERATOR), call)
        for path in sorted(OPERATOR.rglob("*.py"))
        for call in kopf_decorators(ast.parse(path.read_text()))
    ]
    assert len(decorators) >= 10  # the handlers are found: login, startup, indexes, daemon...
    unregistered = [
        f"{path}:{call.lineno} {ast.unparse(call.func)}"
        for path, call in decorators
        if not any(k.arg == "registry" and ast.unparse(k.value) == "registry" for k in call.keywords)
    ]
    assert unregistered == []


def test_importing_the_operator_leaves_kopfs_default_registry_alone() -> None:
    modules = [m for m in operator_modules() if m != "gpuwarden.operator.kopfrun"]
    assert {"gpuwarden.operator.handlers", "gpuwarden.operator.kube.client"} <= set(modules)
    assert default_registry_after_importing(*modules) == "kopf's"


def test_the_kopf_run_shim_makes_the_operators_registry_kopfs_default() -> None:
    assert default_registry_after_importing("gpuwarden.operator.kopfrun") == "the operator's"
