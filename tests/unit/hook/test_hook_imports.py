"""``import gpuwarden.hook`` in a training job pulls in nothing of the operator's dependencies."""

from __future__ import annotations

import subprocess
import sys

HEAVY = (
    "aiohttp",
    "pydantic",
    "prometheus_client",
    "kopf",
    "yaml",
    "grpc",
    "pynvml",
    "torch",
    "transformers",
)


def test_the_hook_imports_the_standard_library_only() -> None:
    code = (
        "import sys, gpuwarden.hook\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
