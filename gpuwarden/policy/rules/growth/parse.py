"""A memoryGrowth rule's body: its fields (the CRD's schema is rendered from them) and their reading."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gpuwarden.policy.rules.growth.model import MemoryGrowth, MemorySource
from gpuwarden.policy.spec.schema import Body, Choice, Duration, Number, Rate

RATE = Rate(
    "rate",
    "The growth rate that counts as a leak: a quantity per time unit, e.g. 100Mi/m (100 MiB a"
    " minute), 2Gi/h or 500k/s.",
    required=True,
)
WINDOW = Duration(
    "window",
    "The longest trailing history the slope is fitted over (a duration such as 30m, at least 1m and"
    " at least evaluationInterval). Shorter spans, from 4m, are judged first; the GPU's samples must"
    " cover a span without gaps before the rule can fire on it.",
    default="30m",
    # The engine fits a line through 20 bucket medians (window/20 each): under a minute, that is noise.
    minimum="1m",
    window=True,
)
MIN_FIT = Number(
    "minFit",
    "How straight the growth must be, 0 to 1: the R² of the fitted line through a span's 20 bucket"
    " medians. A steady ramp scores near 1 even when noisy; a sawtooth (allocate, free) or a staircase"
    " that stopped climbing scores low.",
    minimum=0,
    maximum=1,
    default=0.8,
)
FOR = Duration(
    "for",
    "How long the growth condition must keep holding, re-checked at every evaluation, before the rule"
    " fires (a duration; 0s fires at the first evaluation that sees it; anything else takes whole"
    " evaluation intervals, rounded up).",
    default="0s",
)
MEMORY = Choice(
    "memory",
    "Which memory the rule watches. device: NVML's memory used (what the CUDA caching allocator"
    " reserved; the pod's processes' on a shared GPU). allocated: what live tensors hold"
    " (torch.cuda.memory_allocated, from the gpuwarden training hook): a caching allocator's plateau"
    " never fires. reserved: the allocator's cache (torch.cuda.memory_reserved, from the hook). host:"
    " the resident host memory of the pod's hooked processes and their data-loader workers (from the"
    " hook; its time to full is to the memory limit the hook reports, none without one). auto:"
    " allocated on a GPU whose samples carry the hook's allocated bytes, else device. A GPU (pod, for"
    " host) without readings of the chosen memory is not judged.",
    choices=MemorySource,
    default=MemorySource.AUTO,
)
SNAPSHOT_BEFORE = Duration(
    "snapshotBefore",
    "When a process under this rule's finding is asked for a snapshot of its GPU allocator (the file"
    " PyTorch's memory visualizer opens; only processes whose gpuwarden training hook opted in to"
    " requests are asked, docs/hook.md): once the card is projected full within this long (a duration,"
    " at least 1m) and the"
    " allocator's history has been recorded for 30s (or at once when the card is full within a minute)."
    " One snapshot per finding. 16m is when the finding's reason becomes GPUMemoryExhaustionImminent.",
    default="16m",
    minimum="1m",
)
BODY = Body(
    "Fires when the memory used on one of the pod's GPUs (or, with memory: host, its host memory)"
    " grows steadily (a leak), as soon as the evidence is enough: over some trailing span from 4m (or"
    " the window, when shorter) up to the window, the robust (Theil-Sen) slope's 99% lower bound is at"
    " least rate (the slope itself, when the card is full within twice the span), the growth is"
    " straight enough (fit at least minFit), every quarter of the span grows, it did not rise in a few"
    " jumps, and memory was not higher before the span. Reports the projected time until the GPU is"
    " full.",
    (RATE, WINDOW, MIN_FIT, FOR, MEMORY, SNAPSHOT_BEFORE),
)


def parse_memory_growth(name: str, obj: Mapping[str, Any], path: str) -> MemoryGrowth:
    """A memoryGrowth rule's body (``path`` is its own)."""
    BODY.check(obj, path)
    return MemoryGrowth(
        name=name,
        rate_bytes_per_second=RATE.read(obj, path),
        window_seconds=WINDOW.read(obj, path),
        min_fit=MIN_FIT.read(obj, path),
        for_seconds=FOR.read(obj, path),
        memory=MEMORY.read(obj, path),
        snapshot_before_seconds=SNAPSHOT_BEFORE.read(obj, path),
    )
