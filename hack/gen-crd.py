#!/usr/bin/env python3
"""Render the GPUMonitorPolicy CRD's generated regions from the rule kinds' declarations
(gpuwarden/policy/crd.py), then copy the CRDs into the chart (hack/sync-chart-crds.sh).

Usage: hack/gen-crd.py [--check]
  --check  change nothing; exit 1 when crds/ (or the chart's copy) is not what the declarations make
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from gpuwarden.policy.crd import regenerate

ROOT = Path(__file__).resolve().parents[1]
CRD = ROOT / "crds" / "gpuwarden.dev_gpumonitorpolicies.yaml"
SYNC = [str(ROOT / "hack" / "sync-chart-crds.sh")]


def main(argv: list[str]) -> int:
    if argv not in ([], ["--check"]):
        print(__doc__, file=sys.stderr)
        return 2
    text = CRD.read_text(encoding="utf-8")
    fresh = regenerate(text)
    if argv:
        if fresh != text:
            print(f"gen-crd: {CRD.relative_to(ROOT)} is stale; run make crds", file=sys.stderr)
            return 1
        return subprocess.run([*SYNC, "--check"], check=False).returncode
    if fresh != text:
        CRD.write_text(fresh, encoding="utf-8")
        print(f"gen-crd: wrote {CRD.relative_to(ROOT)}", file=sys.stderr)
    return subprocess.run(SYNC, check=False).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
