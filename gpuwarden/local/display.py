"""How local mode shows a run: a live table on a terminal, plain lines anywhere else.

Both displays print the same lines for what happens (a finding starts, is re-described
under a new reason, is announced again as a reminder, or clears; a scale decision), prefixed
with the time as a :data:`ClockLabel` writes it.

- :class:`LiveDisplay` (stdout is a terminal): those lines scroll above a table of the
  GPUs, and of the simulated scale targets' replicas, redrawn in place with ANSI escapes,
  at most ``refresh`` times a second.
- :class:`PlainDisplay` (a pipe, a file, CI): those lines, and every ``status_every``
  seconds (of the run's time) one status line per GPU and per scale target instead of the table.

Everything here is ASCII apart from what the data brings (a command line), so a log
read with any encoding stays legible.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TextIO

from gpuwarden.local.history import FindingSpan, History
from gpuwarden.local.rows import Announcement, GpuRow, ScaleNote, Step, TargetRow
from gpuwarden.local.scaler import SimulatedTarget
from gpuwarden.policy import FindingTransition, Transition, format_bytes
from gpuwarden.wire.node import DeviceState

ClockLabel = Callable[[float], str]
"""Writes a snapshot time for a line: ``05:10`` into a scenario, ``14:03:22`` on the wall clock."""

SUBJECT_WIDTH = 38
"""Characters of a pod or process name in the table (a command line is cut, not wrapped)."""

_RED, _GREEN, _YELLOW, _BOLD, _DIM, _RESET = (
    "\x1b[31m",
    "\x1b[32m",
    "\x1b[33m",
    "\x1b[1m",
    "\x1b[2m",
    "\x1b[0m",
)

_VERBS = {
    Transition.STARTED: "STARTED",
    Transition.RENOTIFY: "STILL",
    Transition.RESOLVED: "CLEARED",
}
"""What each transition prints; a re-notification under a new reason prints ``CHANGED`` (:class:`Reasons`)."""


_VERB_COLORS = (
    ("STARTED", _RED),
    ("STILL", _YELLOW),
    ("CHANGED", _YELLOW),
    ("CLEARED", _GREEN),
    ("SCALE", _YELLOW),
)


def elapsed_clock(origin: float) -> ClockLabel:
    """Time since ``origin``: ``05:10``, or ``1:05:10`` past an hour."""

    def label(t: float) -> str:
        s = max(0, round(t - origin))
        hours, rest = divmod(s, 3600)
        minutes, seconds = divmod(rest, 60)
        return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes:02d}:{seconds:02d}"

    return label


def wall_clock(t: float) -> str:
    """Local wall-clock time: ``14:03:22``."""
    return time.strftime("%H:%M:%S", time.localtime(t))


# -- lines ----------------------------------------------------------------------------------------


def announcement_line(a: Announcement, clock: ClockLabel, was: str | None = None) -> str:
    """``[05:00] STARTED idle-gpu research/notebook-0 on GPU 0: GPUUnderutilized: mean SM activity …``.

    ``was``: the reason a re-notification's finding was announced under before, when it differs (the
    finding was re-described: ``CHANGED …, (was GPUMemoryLeakSuspected)``); else a re-notification is a
    reminder of the same (``STILL``).
    """
    t = a.transition
    f = t.finding
    where = f" on {', '.join(a.devices)}" if a.devices else ""
    why = f"{f.reason}" if t.resolution is None else f"{t.resolution}"
    changed = t.transition is Transition.RENOTIFY and was is not None and was != f.reason
    verb = "CHANGED" if changed else _VERBS[t.transition]
    line = f"[{clock(t.at)}] {verb:<7} {f.rule} {a.subject}{where}: {why}: {f.message}"
    return f"{line} (was {was})" if changed else line


def scale_line(note: ScaleNote, clock: ClockLabel) -> str:
    """``[02:00] SCALE   scaled Deployment inference/llm-server 1 -> 2 (simulated): saturated on 1/1 pods …``.

    A ``dryRun`` policy's decision reads ``would scale … (policy …; dryRun)``: its target stays.
    """
    d = note.decision
    if note.applied:
        return (
            f"[{clock(note.at)}] SCALE   scaled {note.target} {d.current} -> {d.desired} (simulated): "
            f"{d.reason} (policy {note.policy})"
        )
    return (
        f"[{clock(note.at)}] SCALE   would scale {note.target} {d.current} -> {d.desired}: {d.reason} "
        f"(policy {note.policy}; dryRun)"
    )


def target_text(target: TargetRow) -> str:
    """``Deployment inference/llm-server: 3 replicas (simulated)``; ``(dryRun: stays)`` under dryRun."""
    how = "dryRun: stays" if target.dry_run else "simulated"
    return f"{target.target}: {_replicas(target.replicas)} ({how})"


def _replicas(n: int) -> str:
    return f"{n} replica" if n == 1 else f"{n} replicas"


def percent_cell(value: float | None) -> str:
    """``  3%``; ``   -`` when not read."""
    return "   -" if value is None else f"{value:3.0f}%"


def memory_cell(used: float | None, total: float | None) -> str:
    """``126Gi/140Gi (90%)``."""
    if used is None:
        return "-"
    if total is None or total <= 0:
        return format_bytes(used)
    return f"{format_bytes(used)}/{format_bytes(total)} ({100 * used / total:.0f}%)"


def hook_cell(allocated: float | None, reserved: float | None) -> str:
    """`` alloc 22Gi, cache 24Gi``: a hooked process's tensors and allocator cache; empty without a hook."""
    parts = []
    if allocated is not None:
        parts.append(f"alloc {format_bytes(allocated)}")
    if reserved is not None:
        parts.append(f"cache {format_bytes(reserved)}")
    return " " + ", ".join(parts) if parts else ""


def subject_cell(subjects: Sequence[str], width: int = SUBJECT_WIDTH) -> str:
    """The first subject, cut to ``width``, with ``+N`` for the others."""
    if not subjects:
        return "(none)"
    more = f" +{len(subjects) - 1}" if len(subjects) > 1 else ""
    return _cut(subjects[0], width - len(more)) + more


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "~"


def status_lines(row: GpuRow, clock_text: str) -> list[str]:
    """One GPU as plain lines: ``[05:00] GPU 0 research/notebook-0: util 3%, SM 2%, mem …; findings: …``,
    then on a shared GPU one line per pod or process with its own share:
    ``[05:00]   pid 51002 python …: util 0%, mem 10Gi; findings: idle``."""
    subject = ", ".join(row.subjects) or "(none)"
    if row.state is not DeviceState.OK:
        return [f"[{clock_text}] {row.name} {subject}: {row.state.value}"]
    findings = ", ".join(row.findings) or "none"
    memory = memory_cell(row.memory_used, row.memory_total) + hook_cell(row.allocated, row.reserved)
    lines = [
        f"[{clock_text}] {row.name} {subject}: util {percent_cell(row.utilization).strip()}, "
        f"SM {percent_cell(row.sm_active).strip()}, mem {memory}; "
        f"findings: {findings}"
    ]
    for share in row.shares:
        memory = memory_cell(share.memory_used, None) + hook_cell(share.allocated, share.reserved)
        lines.append(
            f"[{clock_text}]   {share.subject}: util {percent_cell(share.utilization).strip()}, "
            f"mem {memory}; findings: {', '.join(share.findings) or 'none'}"
        )
    return lines


def render_table(
    rows: Iterable[GpuRow],
    title: str,
    *,
    subject_header: str,
    color: bool = False,
    targets: Iterable[TargetRow] = (),
) -> list[str]:
    """The live table: a title, a header, one line per GPU and one per scale target (no line ends).

    A shared GPU's line counts its subjects; each follows on its own line, indented, with its
    own utilization (per-process SM: GPM cannot be split, so its SM column is ``-``), memory
    and findings. Where a training hook reports them, the memory column adds what live tensors
    and the allocator's cache hold (``alloc 22Gi, cache 24Gi``), and widens to fit.
    """
    rows = list(rows)
    cells = [memory_cell(r.memory_used, r.memory_total) + hook_cell(r.allocated, r.reserved) for r in rows]
    share_cells = [
        [memory_cell(s.memory_used, None) + hook_cell(s.allocated, s.reserved) for s in r.shares]
        for r in rows
    ]
    width = max([20, *map(len, cells), *(len(c) for cs in share_cells for c in cs)])
    header = (
        f"{'GPU':<7} {subject_header.upper():<{SUBJECT_WIDTH}} {'UTIL':>4} {'SM':>4}  "
        f"{'MEMORY':<{width}} FINDINGS"
    )
    lines = [_paint(title, _BOLD, color), _paint(header, _DIM, color)]
    for row, memory, share_memory in zip(rows, cells, share_cells, strict=True):
        name = row.name if len(row.name) <= 7 else row.name[:6] + "~"
        subject = subject_cell(row.subjects)
        if row.state is not DeviceState.OK:
            lines.append(
                f"{name:<7} {subject:<{SUBJECT_WIDTH}} {_paint(row.state.value.upper(), _RED, color)}"
            )
            continue
        if row.shares:
            plural = subject_header + ("es" if subject_header.endswith("s") else "s")
            subject = f"({len(row.shares)} {plural})"
        lines.append(
            f"{name:<7} {subject:<{SUBJECT_WIDTH}} {percent_cell(row.utilization)} "
            f"{percent_cell(row.sm_active)}  {memory:<{width}} {_findings_cell(row.findings, color)}"
        )
        for share, cell in zip(row.shares, share_memory, strict=True):
            lines.append(
                f"{'':<7} {_cut('  ' + share.subject, SUBJECT_WIDTH):<{SUBJECT_WIDTH}} "
                f"{percent_cell(share.utilization)} {percent_cell(None)}  "
                f"{cell:<{width}} {_findings_cell(share.findings, color)}"
            )
    for target in targets:
        lines.append(_paint(target_text(target), _BOLD, color))
    return lines


def _findings_cell(findings: Sequence[str], color: bool) -> str:
    return _paint(", ".join(findings), _RED, color) if findings else _paint("-", _DIM, color)


def _paint(text: str, code: str, color: bool) -> str:
    return f"{code}{text}{_RESET}" if color else text


def use_color(out: TextIO) -> bool:
    """Color on a terminal, unless ``NO_COLOR`` is set (no-color.org) or the terminal is dumb."""
    return out.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


# -- displays -------------------------------------------------------------------------------------


class PlainDisplay:
    """Lines only: what happens as it happens, and a status line per GPU every ``status_every`` seconds."""

    def __init__(self, out: TextIO, clock: ClockLabel, *, status_every: float | None = 300.0) -> None:
        self._out = out
        self._clock = clock
        self._status_every = status_every
        self._next_status: float | None = None
        self._repeats = ScaleRepeats()
        self._reasons = Reasons()

    def show(self, step: Step, title: str = "") -> None:
        """Print a step's announcements and scale decisions, and the status when due."""
        for line in step_lines(step, self._clock, self._repeats, self._reasons):
            print(line, file=self._out)
        if self._status_every is not None and (self._next_status is None or step.at >= self._next_status):
            self._next_status = step.at + self._status_every
            for row in step.rows:
                for line in status_lines(row, self._clock(step.at)):
                    print(line, file=self._out)
            for target in step.targets:
                print(f"[{self._clock(step.at)}] {target_text(target)}", file=self._out)
        self._out.flush()

    def note(self, text: str) -> None:
        """Print a line of the caller's."""
        print(text, file=self._out, flush=True)

    def close(self) -> None:
        """Nothing to restore."""


class LiveDisplay:
    """Announcements scrolling above a GPU table redrawn in place (ANSI), throttled to ``refresh`` s."""

    def __init__(
        self,
        out: TextIO,
        clock: ClockLabel,
        *,
        subject_header: str,
        refresh: float = 0.1,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._out = out
        self._clock = clock
        self._subject_header = subject_header
        self._refresh = refresh
        self._monotonic = monotonic
        self._color = use_color(out)
        self._drawn = 0
        self._last_draw: float | None = None
        self._last: tuple[Step, str] | None = None
        self._repeats = ScaleRepeats()
        self._reasons = Reasons()
        self._out.write("\x1b[?25l")  # the cursor would flicker across the redrawn table

    def show(self, step: Step, title: str = "") -> None:
        """Print what happened at once; redraw the table when due (or when something happened)."""
        self._last = (step, title)
        lines = step_lines(step, self._clock, self._repeats, self._reasons)
        now = self._monotonic()
        due = self._last_draw is None or now - self._last_draw >= self._refresh
        if lines or due:
            self._redraw(lines, step, title)
            self._last_draw = now

    def note(self, text: str) -> None:
        """Print a line of the caller's above the table."""
        if self._last is None:
            print(text, file=self._out, flush=True)
            return
        self._redraw([text], *self._last)

    def close(self) -> None:
        """Draw the final table and leave it on screen; give the cursor back."""
        if self._last is not None:
            self._redraw([], *self._last)
        self._out.write("\x1b[?25h")
        self._out.flush()

    def _redraw(self, lines: Sequence[str], step: Step, title: str) -> None:
        width = shutil.get_terminal_size((120, 24)).columns
        parts: list[str] = []
        if self._drawn:
            # To the start of the table's first line, and clear everything below.
            parts.append(f"\x1b[{self._drawn}F\x1b[J")
        for line in lines:
            parts.append(self._painted(line) + "\n")
        table = render_table(
            step.rows, title, subject_header=self._subject_header, color=self._color, targets=step.targets
        )
        # A line wider than the terminal wraps and breaks the count of lines to go back up.
        parts.extend(_fit(line, width) + "\n" for line in table)
        self._drawn = len(table)
        self._out.write("".join(parts))
        self._out.flush()

    def _painted(self, line: str) -> str:
        if not self._color:
            return line
        for verb, code in _VERB_COLORS:
            marker = f"] {verb}"
            if marker in line:
                return line.replace(marker, f"] {code}{verb}{_RESET}", 1)
        return line


def _fit(line: str, width: int) -> str:
    """Cut a line to ``width`` visible characters, leaving ANSI escapes whole."""
    out: list[str] = []
    visible = 0
    i = 0
    while i < len(line):
        if line[i] == "\x1b":
            end = line.find("m", i)
            end = len(line) - 1 if end < 0 else end
            out.append(line[i : end + 1])
            i = end + 1
            continue
        if visible >= width - 1:
            break
        out.append(line[i])
        visible += 1
        i += 1
    text = "".join(out)
    cut = i < len(line)
    return text + _RESET if cut and "\x1b[" in text else text


class ScaleRepeats:
    """Lets a scale decision through once until it changes.

    A ``dryRun`` policy's target keeps its replicas, so the same "would scale 1 -> 2"
    comes back at every cooldown; the summary counts the repeats. (A simulated target
    that follows its decisions never repeats one: each starts where the last ended.)
    """

    def __init__(self) -> None:
        self._last: dict[tuple[str, str], tuple[int, int]] = {}

    def fresh(self, note: ScaleNote) -> bool:
        """Whether ``note`` differs from the last one of its policy and target."""
        key, value = (note.policy, note.target), (note.decision.current, note.decision.desired)
        if self._last.get(key) == value:
            return False
        self._last[key] = value
        return True


class Reasons:
    """The reason each active finding was last announced under, so that a re-notification says whether
    it re-describes the finding (its reason changed: ``CHANGED``) or reminds of it (``STILL``)."""

    def __init__(self) -> None:
        self._last: dict[tuple[str, str, str, str], str] = {}

    def before(self, t: FindingTransition) -> str | None:
        """The reason ``t``'s finding was announced under before ``t`` (None: not yet); records ``t``."""
        f = t.finding
        key = (f.policy, f.rule, f.namespace, f.pod)
        was = self._last.get(key)
        if t.transition is Transition.RESOLVED:
            self._last.pop(key, None)
        else:
            self._last[key] = f.reason
        return was


def step_lines(
    step: Step, clock: ClockLabel, repeats: ScaleRepeats | None = None, reasons: Reasons | None = None
) -> list[str]:
    """A step's announcements and scale decisions as lines (repeated decisions left out; with
    ``reasons``, a re-notification under a new reason says so)."""
    notes = [n for n in step.scaling if repeats is None or repeats.fresh(n)]
    lines = [
        announcement_line(a, clock, None if reasons is None else reasons.before(a.transition))
        for a in step.announcements
    ]
    return lines + [scale_line(n, clock) for n in notes]


# -- summary --------------------------------------------------------------------------------------


def summary_lines(
    history: History,
    scaling: Sequence[ScaleNote],
    clock: ClockLabel,
    targets: Sequence[SimulatedTarget] = (),
) -> list[str]:
    """Per GPU, what it ran and what was found; the scale targets and decisions; the counts."""
    lines: list[str] = []
    width = max((len(d.name) for d in history.devices.values()), default=5)
    spelled_out: set[str] = set()
    for key, device in history.devices.items():
        subject = ", ".join(device.subjects) or "(nothing ran on it)"
        spans = [s for s in history.spans if key in s.devices]
        lines.append(f"  {device.name:<{width}}  {subject}")
        # Lines and the table cut a command line short; here it is whole, once per subject.
        for name in device.subjects:
            full = history.full_names.get(name)
            if full is not None and name not in spelled_out:
                spelled_out.add(name)
                lines.append(f"  {'':<{width}}    in full: {full}")
        if not spans:
            lines.append(f"  {'':<{width}}    no findings")
        for span in spans:
            # On a GPU several subjects shared, each finding says whose it is.
            whose = f"{span.subject}: " if len(device.subjects) > 1 else ""
            lines.append(f"  {'':<{width}}    {whose}{_span_text(span, clock)}")
    elsewhere = [s for s in history.spans if not any(d in history.devices for d in s.devices)]
    for span in elsewhere:
        lines.append(f"  {span.subject}: {_span_text(span, clock)}")
    for text in _scale_summary(scaling, targets):
        lines.append(f"  {text}")
    started = len(history.spans)
    active = len(history.active())
    lines.append(f"  {started} findings started, {started - active} cleared, {active} active at the end.")
    return lines


def _span_text(span: FindingSpan, clock: ClockLabel) -> str:
    when = (
        f"since {clock(span.start)}"
        if span.end is None
        else f"{clock(span.start)}-{clock(span.end)}, cleared: {span.resolution}"
    )
    return f"{span.rule} ({span.reason}) {when}: {span.last_message}"


def _scale_summary(scaling: Sequence[ScaleNote], targets: Sequence[SimulatedTarget]) -> list[str]:
    """Each simulated target from its first replicas to its last; a dryRun policy's repeated wishes."""
    out = []
    for t in targets:
        if t.dry_run:
            continue  # its wishes, counted below, say more than replicas that never moved
        moves = [
            f"{n} scale-{way}" + ("s" if n > 1 else "")
            for n, way in ((t.scaled_up, "up"), (t.scaled_down, "down"))
            if n
        ]
        what = f"{t.initial} -> {_replicas(t.replicas)}" if moves else f"{_replicas(t.replicas)} throughout"
        how = f", {', '.join(moves)}" if moves else ""
        out.append(f"{t.target}: {what} (simulated; dry run in local mode){how}; policy {t.policy}")
    counts: dict[tuple[str, str, int, int], int] = {}
    for note in scaling:
        if note.applied:
            continue  # in the target's line above
        key = (note.policy, note.target, note.decision.current, note.decision.desired)
        counts[key] = counts.get(key, 0) + 1
    for (policy, target, current, desired), count in counts.items():
        times = "once" if count == 1 else f"{count} times (once per cooldown)"
        out.append(f"{target}: would scale {current} -> {desired}, {times} (dryRun); policy {policy}")
    return out
