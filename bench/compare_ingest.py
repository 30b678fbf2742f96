"""bench/ingest.py side by side: several revisions, each with its own bench, alternated in one run.

Not a test: the regression guard of docs/benchmarks.md ("The ingest path side by side"). Each
revision is exported once (``git archive``, into ``--trees``, outside the repository: no entry in
its worktree list, reused by commit) and run with this interpreter; ``.`` is this checkout as it
is, uncommitted edits included. The rounds alternate the revisions (old, new, old, new) with the
same bench arguments, so that a machine's drift lands on every revision alike. Each run's JSON
summary is printed as it comes (stderr); at the end, the table:

- reports/s, and per core: reports a second over the server's CPU share (the server is pinned to
  one CPU; where the load cannot fill it, the per-core figure is the comparable one);
- ingest µs/report: the server's CPU a report, evaluation's CPU left out (the bench's own figure);
- p99 evaluation delay;
- 503 answers over the whole run, and (revisions whose bench says so) their reasons in the measured
  window: ``unavailable`` is the TokenReview budget for never-seen tokens refusing past its rate
  (overload protection: the load's nodes all start with new tokens at once; the agent retries a
  second later), ``standby`` a replica that does not act.

    .venv/bin/python bench/compare_ingest.py d88edff cee149e . -- --nodes 500 --mode capacity \\
        --seconds 20 --warmup 10 --load-processes 1

``--profile`` runs each revision once more under cProfile, the server's measured window only (not
its pre-fill, not the warmup), whatever that revision's bench can profile, and prints each one's
top functions by own time and its CPU by part of the path (:data:`PARTS`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

PARTS = (
    ("wire parse (pydantic or msgspec)", ("validate_json", "msgspec", "/wire/", "nodereport")),
    ("accounting", ("/accounting/",)),
    ("GPU health store", ("health",)),
    ("series store and intake", ("/policy/store/", "/policy/series", "/policy/intake")),
    ("admission (accept)", ("operator/admission.py", "operator/state.py", "operator/metrics.py")),
    ("endpoint (auth, limits, body, answer)", ("/operator/endpoints/", "/operator/ingest.py", "tokenreview")),
    ("evaluation (engine, rules, runner)", ("/policy/", "/operator/policies/", "/operator/evaluation")),
    (
        "HTTP and TLS (aiohttp, asyncio, ssl)",
        ("aiohttp", "asyncio", "ssl", "selectors", "socket", "multidict"),
    ),
)
"""Parts of the path, by the first of their file (or built-in) name fragments a function matches."""


def tree(rev: str, trees: Path) -> tuple[str, Path]:
    """The label and the directory of ``rev``'s tree (exported once); ``.``: this checkout."""
    if rev == ".":
        return ".", REPO
    sha = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{rev}^{{commit}}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    where = trees / sha
    if not (where / "bench" / "ingest.py").exists():
        partial = Path(tempfile.mkdtemp(prefix=f"{sha[:12]}-", dir=trees))
        archive = subprocess.Popen(["git", "-C", str(REPO), "archive", sha], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(partial)], stdin=archive.stdout, check=True)
        if archive.wait() != 0:
            raise SystemExit(f"git archive {sha} failed")
        partial.rename(where)  # whole or absent: a run cut short leaves no half tree behind
    return rev, where


def run(directory: Path, bench_args: list[str], nice: int) -> dict[str, Any]:
    """One run of ``directory``'s bench/ingest.py; its JSON summary."""
    command = [sys.executable, str(directory / "bench" / "ingest.py"), *bench_args]
    if nice:
        command = ["nice", "-n", str(nice), *command]
    done = subprocess.run(command, cwd=directory, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
    summary: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    return summary


def profiled_server_main(args: argparse.Namespace, port_queue: Any, stop_event: Any) -> None:
    """A revision's server (its bench's ``serve``) under cProfile from the measured window's start
    (warmup after the load's start, 2 s after the port is announced) for ``args.seconds``."""
    import asyncio
    import cProfile

    import ingest  # the revision's bench, first on sys.path (profile_one)

    os.sched_setaffinity(0, {args.server_cpu})
    profiler = cProfile.Profile()

    class Announce:
        def put(self, port: int) -> None:
            loop = asyncio.get_running_loop()
            loop.call_later(2.0 + args.warmup, profiler.enable)
            loop.call_later(2.0 + args.warmup + args.seconds, profiler.disable)
            port_queue.put(port)

    asyncio.run(ingest.serve(args, Announce(), stop_event))
    profiler.disable()
    profiler.dump_stats(os.environ["INGEST_PROFILE_OUT"])


def profile_one(directory: Path, bench_args: list[str], out: Path) -> None:
    """Run ``directory``'s bench with its server under :func:`profiled_server_main` (this process)."""
    sys.path[:0] = [str(directory / "bench"), str(directory)]
    import ingest

    os.environ["INGEST_PROFILE_OUT"] = str(out)
    ingest.server_main = profiled_server_main
    sys.argv = [str(directory / "bench" / "ingest.py"), *bench_args]
    ingest.main()


def parts(stats: Any) -> dict[str, float]:
    """Own CPU seconds by part of the path (:data:`PARTS`); the rest is "other"."""
    out = {name: 0.0 for name, _ in PARTS} | {"other": 0.0}
    for (filename, _, function), (_, _, tottime, _, _) in stats.stats.items():
        where = f"{filename}:{function}"
        name = next((n for n, marks in PARTS if any(m in where for m in marks)), "other")
        out[name] += tottime
    return out


def profile(revs: list[tuple[str, Path]], bench_args: list[str], nice: int, top: int) -> None:
    import pstats

    for label, directory in revs:
        out = Path(tempfile.mkdtemp(prefix="ingest-profile-")) / "server.prof"
        command = [sys.executable, __file__, "--profile-tree", str(directory), "--profile-out", str(out)]
        command += ["--", *bench_args]
        if nice:
            command = ["nice", "-n", str(nice), *command]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{' '.join(command)} failed:\n{done.stderr[-4000:]}")
        summary = json.loads(done.stdout[done.stdout.index("{") :])
        stats = pstats.Stats(str(out))
        reports = summary["reports_per_s"] * float(bench_args[bench_args.index("--seconds") + 1])
        print(f"\n## {label}: {summary['reports_per_s']:,.0f} reports/s under the profiler ({out})\n")
        print("| part of the path | CPU s | µs a report |\n|---|---|---|")
        for name, seconds in parts(stats).items():
            print(f"| {name} | {seconds:.2f} | {1e6 * seconds / max(1.0, reports):.0f} |")
        print()
        stats.sort_stats("tottime").print_stats(top)


def per_core(summary: dict[str, Any]) -> float:
    share = summary["server_cpu_share"]
    return float(summary["reports_per_s"]) / share if share else float("nan")


def over_floor(summary: dict[str, Any]) -> str:
    """Ingest CPU a report over its floor (``json.loads`` + pydantic's parse of the same body, on the
    server's CPU), where the revision's bench measures the floor."""
    floor = summary.get("floor_us")
    if not floor:
        return "n/a"
    return format(summary["ingest_cpu_us_per_report"] / (floor["json_loads"] + floor["parse_report"]), ".2f")


def unavailable(summary: dict[str, Any]) -> str:
    """The measured window's 503s by reason, where the revision's bench counts them."""
    rejected = summary.get("rejected", {})
    reasons = {r: int(rejected[r]) for r in ("unavailable", "standby") if r in rejected}
    return ", ".join(f"{r} {n:,}" for r, n in reasons.items()) if reasons else "n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("revs", nargs="*", help="revisions, oldest first; '.' is this checkout as it is")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each revision, alternated")
    parser.add_argument("--trees", default=os.path.join(tempfile.gettempdir(), "gpuwarden-ingest-trees"))
    parser.add_argument("--nice", type=int, default=0, help="run each bench under nice -n this")
    parser.add_argument("--profile", action="store_true", help="profile each revision once instead")
    parser.add_argument("--top", type=int, default=20, help="--profile: functions shown, by own time")
    parser.add_argument("--profile-tree", help=argparse.SUPPRESS)
    parser.add_argument("--profile-out", help=argparse.SUPPRESS)
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:split])
    bench_args = argv[split + 1 :]  # after --: bench/ingest.py's arguments
    if args.profile_tree:
        profile_one(Path(args.profile_tree), bench_args, Path(args.profile_out))
        return 0
    trees = Path(args.trees)
    trees.mkdir(parents=True, exist_ok=True)
    revs = [tree(rev, trees) for rev in args.revs]
    if args.profile:
        profile(revs, bench_args, args.nice, args.top)
        return 0

    results: dict[str, list[dict[str, Any]]] = {label: [] for label, _ in revs}
    for round_ in range(1, args.rounds + 1):
        for label, directory in revs:
            summary = run(directory, bench_args, args.nice)
            results[label].append(summary)
            print(f"# round {round_}, {label}: {json.dumps(summary)}", file=sys.stderr, flush=True)

    print(f"bench/ingest.py {' '.join(bench_args)}; {args.rounds} rounds, alternated\n")
    print(
        "| tree | reports/s | reports/s per core | ingest µs / report | p99 evaluation delay "
        "| 503 answers (whole run) | 503s measured, by reason | ingest / floor |"
    )
    print("|---|---|---|---|---|---|---|---|")
    notes: list[str] = []
    for label, _ in revs:
        runs = results[label]

        def each(value: Any, fmt: str, runs: list[dict[str, Any]] = runs) -> str:
            return " · ".join(format(value(s), fmt) for s in runs)

        print(
            f"| {label} | {each(lambda s: s['reports_per_s'], ',.0f')} | {each(per_core, ',.0f')} "
            f"| {each(lambda s: s['ingest_cpu_us_per_report'], '.1f')} "
            f"| {each(lambda s: s['evaluation_delay_ms']['p99'], ',.0f')} ms "
            f"| {each(lambda s: s['statuses'].get('503', 0), ',')} | {' · '.join(map(unavailable, runs))} "
            f"| {' · '.join(map(over_floor, runs))} |"
        )
        floors = [s["floor_us"] for s in runs if s.get("floor_us")]
        if floors:
            described = " · ".join(", ".join(f"{name} {us}" for name, us in f.items()) for f in floors)
            notes.append(f"{label}: floor µs a report ({described})")
    print("\n".join(["", *notes]))
    base = statistics.median(per_core(s) for s in results[revs[0][0]])
    print()
    for label, _ in revs[1:]:
        ratio = statistics.median(per_core(s) for s in results[label]) / base
        print(f"{label} against {revs[0][0]}: {ratio:.2f}x the reports a second per core (medians)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
