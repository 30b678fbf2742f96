"""StepHook: the interval (on an injected clock), what a reading holds, failures kept from the loop,
the background thread of ``with hook:``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hook_socket_support import Connection, LineServer

from gpuwarden.hook import DeviceMemory, HookClient, ScriptedMemory, StepHook

WALL = 1764770000.5


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def server(tmp_path: Path) -> Iterator[LineServer]:
    srv = LineServer(tmp_path / "hook.sock")
    yield srv
    srv.close()


def leak(start: int, per_read: int) -> Iterator[list[DeviceMemory]]:
    n = 0
    while True:
        yield [DeviceMemory("GPU-aa", start + n * per_read, 2 * start, start + n * per_read)]
        n += 1


def make_hook(server: LineServer, clock: Clock, **kwargs: object) -> StepHook:
    options: dict[str, object] = {
        "memory": ScriptedMemory(leak(1000, 10)),
        "tracemalloc": False,
        "client": HookClient(str(server.path)),
        "clock": clock,
        "wall": lambda: WALL,
        "host_rss": lambda: 4096,
        "host_limit": lambda: 8192,
    }
    options.update(kwargs)
    return StepHook(interval=5.0, **options)  # type: ignore[arg-type]


def test_reads_at_most_once_per_interval(server: LineServer) -> None:
    clock = Clock()
    hook = make_hook(server, clock)
    hook.step()  # the first step reads at once
    conn = server.accept()
    first = conn.message()
    for _ in range(4):
        clock.now += 1.0
        hook.step()  # steps 2..5, within the interval: no reading
    assert hook.client.unanswered == 1
    clock.now += 1.0
    hook.step()  # step 6, 5 s after the first reading
    second = conn.message()
    assert hook.client.unanswered == 2
    assert first == {
        "v": 1,
        "timestamp": WALL,
        "step": 1,
        "devices": [
            {"uuid": "GPU-aa", "allocatedBytes": 1000, "reservedBytes": 2000, "maxAllocatedBytes": 1000}
        ],
        "hostRssBytes": 4096,
        "hostLimitBytes": 8192,
    }
    assert second["step"] == 6
    assert second["devices"][0]["allocatedBytes"] == 1010  # the scripted reader's next reading


def test_an_explicit_step_number_is_sent(server: LineServer) -> None:
    hook = make_hook(server, Clock())
    hook.step(41)
    assert server.accept().message()["step"] == 41


def test_without_torch_it_sends_host_memory_only_and_says_so_once(
    server: LineServer, caplog: pytest.LogCaptureFixture
) -> None:
    # This machine has no torch (the unit suite must pass without it).
    clock = Clock()
    caplog.set_level("INFO", "gpuwarden.hook")
    hook = make_hook(server, clock, memory=None)
    assert hook.memory is None
    hook.step()
    clock.now += 10
    hook.step()
    conn = server.accept()
    for _ in range(2):
        message = conn.message()
        assert message["devices"] == []
        assert message["hostRssBytes"] == 4096
    assert len([r for r in caplog.records if "torch is not installed" in r.message]) == 1


class BrokenMemory:
    def read(self) -> list[DeviceMemory]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def test_a_failing_reader_costs_its_part_never_the_loop(
    server: LineServer, caplog: pytest.LogCaptureFixture
) -> None:
    clock = Clock()
    hook = make_hook(server, clock, memory=BrokenMemory(), host_rss=lambda: 1 // 0, host_limit=lambda: 1 // 0)
    hook.step()
    clock.now += 10
    hook.step()
    conn = server.accept()
    for step in (1, 2):
        assert conn.message() == {"v": 1, "timestamp": WALL, "step": step, "devices": []}
    assert len([r for r in caplog.records if "reading device memory failed" in r.message]) == 1


def test_no_agent_never_reaches_the_loop(tmp_path: Path) -> None:
    clock = Clock()
    hook = StepHook(tracemalloc=False, client=HookClient(str(tmp_path / "absent.sock")), clock=clock)
    for _ in range(3):
        hook.step()
        clock.now += 10
    hook.close()
    assert hook.client.dropped == 4  # three steps and the closing reading


def read_until_step(conn: Connection, step: int) -> dict[str, object]:
    while True:
        message = conn.message()
        if message.get("step") == step:
            return message


def test_with_hook_a_thread_reads_and_the_steps_only_count(server: LineServer) -> None:
    hook = make_hook(server, Clock())
    hook.interval = 3600  # the thread's first reading and the closing one, nothing between
    with hook:
        conn = server.accept()
        assert "step" not in conn.message()  # the thread reads as it starts, before any step
        for _ in range(3):
            hook.step()
    assert conn.message()["step"] == 3  # the next reading is the closing one: steps did not read
    assert conn.line() == b""  # and the connection closed with the hook


def test_tracemalloc_from_the_environment_names_the_keeping_line_not_the_hooks_own(
    server: LineServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUWARDEN_HOOK_TRACEMALLOC", "1")
    monkeypatch.setenv("GPUWARDEN_HOOK_TRACEMALLOC_FRAMES", "4")
    clock = Clock()
    hook = make_hook(server, clock, tracemalloc=None)
    assert hook.tracker is not None
    assert hook.tracker.frames == 4
    kept: list[bytearray] = []
    try:
        for _ in range(4):
            kept.extend(bytearray(500) for _ in range(100))  # the job keeps these
            hook.step()  # the hook's own memory is allocated under this line
            clock.now += 5
    finally:
        hook.close()
    conn = server.accept()
    messages = [conn.message() for _ in range(5)]
    assert messages[0]["sites"] == messages[1]["sites"] == []  # the set-up forgotten, the baseline
    lines = Path(__file__).read_text().splitlines()
    keeping = next(n for n, t in enumerate(lines, 1) if t.endswith("# the job keeps these"))
    stepping = keeping + 1
    last = {s["line"]: s for s in messages[-1]["sites"] if s["file"].endswith("test_hook_step.py")}
    assert last[keeping]["count"] > {s["line"]: s for s in messages[2]["sites"]}[keeping]["count"]
    assert stepping not in last
