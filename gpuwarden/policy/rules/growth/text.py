"""memoryGrowth's verdicts in words: the trend, the time to full, what changed, the allocation sites."""

from __future__ import annotations

from gpuwarden.policy.humanize import approx_duration, format_bytes
from gpuwarden.policy.rules.common import Outcome
from gpuwarden.policy.rules.growth.model import (
    CLEAR_RECENT,
    MESSAGE_SITES,
    SITE_FILE_CHARS,
    Change,
    MemorySource,
)
from gpuwarden.units import format_duration
from gpuwarden.wire.node import AllocationSite, HookAnswerBody

MEMORY_NOUNS = {
    MemorySource.DEVICE: "GPU memory",
    MemorySource.ALLOCATED: "allocated memory (live tensors, not the cache)",
    MemorySource.RESERVED: "reserved memory (the allocator's cache)",
    MemorySource.HOST: "host memory (the hooked processes and their workers)",
}
"""How a message names the memory it judged (``auto`` says which of the two it read)."""


def describe(
    slope: float,
    fit: float,
    total_bytes: float | None,
    seconds_to_full: float | None,
    span: float = 0.0,
    memory: MemorySource = MemorySource.DEVICE,
) -> str:
    """``GPU memory grows 212Mi/m over 4m, fit 0.97; the card (80Gi) is full in 14m``.

    ``memory`` names what was judged (:data:`MEMORY_NOUNS`); host memory fills its limit, not a card
    (``total_bytes`` is the limit then; None: no limit known).
    """
    per_minute = slope * 60
    over = f" over {format_duration(span)}" if span > 0 else ""
    noun = MEMORY_NOUNS[memory]
    if per_minute >= 2**10:
        text = f"{noun} grows {format_bytes(per_minute)}/m{over}, fit {fit:.2f}"
    elif per_minute <= -(2**10):
        return f"{noun} shrinks {format_bytes(-per_minute)}/m{over}, fit {fit:.2f}"
    else:
        return f"{noun} is flat{over} (fit {fit:.2f})"
    if memory is MemorySource.HOST:
        if seconds_to_full is None or total_bytes is None:
            return text + "; no memory limit is known, so no time to full"
        limit = format_bytes(total_bytes)
        if seconds_to_full <= 0:
            text += f"; at its memory limit ({limit})"
        else:
            text += f"; its memory limit ({limit}) is reached in {approx_duration(seconds_to_full)}"
    elif seconds_to_full is not None and total_bytes is not None:
        if seconds_to_full <= 0:
            text += f"; the card is full ({format_bytes(total_bytes)})"
        else:
            text += f"; the card ({format_bytes(total_bytes)}) is full in {approx_duration(seconds_to_full)}"
    return text


def growth_message(o: Outcome) -> str:
    """:func:`describe` of the worst GPU, ``(on 1 of 2 GPUs)`` for a pod of several, and the top sites.

    A clearing whose trend still grows says instead what changed (:func:`change_text`), when the
    shortest span was judged.
    """
    memory = MemorySource(o.signal) if o.signal else MemorySource.DEVICE
    if isinstance(o.extra, Change):
        return change_text(o.extra, memory, o.threshold)
    text = describe(o.value or 0.0, o.fit or 0.0, o.total_bytes, o.seconds_to_full, o.window_seconds, memory)
    if o.gpu_count > 1 and o.gpus and memory is not MemorySource.HOST:
        text += f" (on {len(o.gpus)} of {o.gpu_count} GPUs)"
    if isinstance(o.extra, tuple) and o.extra:
        sites = o.extra[:MESSAGE_SITES]
        gpu = [site_text(s) for s in sites if s.memory == "gpu"]
        host = [site_text(s) for s in sites if s.memory != "gpu"]
        if gpu:
            text += "; on the GPU by line: " + ", ".join(gpu)
        if host:
            text += "; top growing lines: " + ", ".join(host)
    return text


def change_text(change: Change, memory: MemorySource, rate: float) -> str:
    """``GPU memory fell from 40Gi to 20Gi over the last 4m``, ``...: no growth over the last 4m (20Gi)``."""
    noun = MEMORY_NOUNS[memory]
    over = f"over the last {format_duration(change.span_seconds)}"
    rise = change.last - change.first
    if rise < -CLEAR_RECENT * rate * change.span_seconds:
        return f"{noun} fell from {format_bytes(change.first)} to {format_bytes(change.last)} {over}"
    if rise < 2**20:
        return f"{noun}: no growth {over} ({format_bytes(change.last)})"
    return f"{noun} grew only {format_bytes(rise)} {over}, to {format_bytes(change.last)}"


def site_text(site: AllocationSite) -> str:
    """``train.py:88 +50Mi (1,200 blocks)``: the file's last two path parts, bounded in length. A GPU
    line (the allocator's history) says what it holds: ``train.py:35 holds 41.2Gi (+36.9Gi/m)``; the
    blocks no Python frame allocated, line 0, are named alone (``<no Python frames> holds 312Mi``)."""
    parts = site.file.replace("\\", "/").rsplit("/", 2)
    name = "/".join(parts[-2:])
    if len(name) > SITE_FILE_CHARS:
        name = "…" + name[-(SITE_FILE_CHARS - 1) :]
    if site.memory == "gpu":
        where = f"{name}:{site.line}" if site.line else name
        rate = site.growth_bytes_per_minute
        return f"{where} holds {format_bytes(site.size_bytes)}" + (
            f" (+{format_bytes(rate)}/m)" if rate else ""
        )
    blocks = "block" if site.count == 1 else "blocks"
    return f"{name}:{site.line} +{format_bytes(site.growth_bytes)} ({site.count:,} {blocks})"


def answer_text(answer: HookAnswerBody) -> str:
    """A hook's answer as a line says it: the file and its top lines, or why it was refused. What the
    job wrote is shown printable only (no terminal escapes, no line breaks from a job's strings)."""
    if answer.status != "ok":
        text = f"refused: {answer.reason}"
    elif answer.file is None:
        text = "ok"
    else:
        lines = ", ".join(site_text(site) for site in answer.sites)
        size = f" ({format_bytes(answer.size_bytes)})" if answer.size_bytes is not None else ""
        text = f"{answer.file}{size}" + (f"; top lines: {lines}" if lines else "")
    return "".join(c if c.isprintable() else "?" for c in text)
