"""idleGpus on real GPUs: one torch process holding two GPUs and working on one of them.

Needs a machine with two GPUs or more (the device kind ``nvidia-h200-x2``); run there, never in CI:

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_idle_gpus_gpu.py -s

The child (``one_of_two_job``, tests/gpu/conftest.py) loads a copy of its weights on ``cuda:1`` and
never uses it: bf16 matmuls without pause on ``cuda:0``, 2 GiB more held on ``cuda:1`` with no kernel
after the copy. `gpuwarden watch` judges each process on the GPUs it holds memory on, so the process's
two GPUs are judged together, as a pod's are in a cluster. A second child (``both_gpus_job``) works on
both; the two share each GPU, so each is judged by its own per-process SM utilization (read every 2 s
here). The rule's window is 20 s: watch must start ``GPUIdleInPod`` naming one of two GPUs idle for
the first child, and nothing for the second.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from watch_support import watch_for

pytestmark = pytest.mark.gpu

WATCHED_SECONDS = 45


def test_watch_finds_the_gpu_a_process_holds_and_leaves_idle(
    one_of_two_job: subprocess.Popen[str], both_gpus_job: subprocess.Popen[str], tmp_path: Path
) -> None:
    out = watch_for(WATCHED_SECONDS, "{name: unused, idleGpus: {for: 20s}}", tmp_path)
    found = re.search(rf"STARTED unused pid {one_of_two_job.pid}\b[^\n]*GPUIdleInPod: 1 of 2 GPUs idle", out)
    assert found is not None, out
    assert not re.search(rf"STARTED unused pid {both_gpus_job.pid}\b", out), out
