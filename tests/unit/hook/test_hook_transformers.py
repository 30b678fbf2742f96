"""The Trainer callback, driven by transformers' own CallbackHandler (what a Trainer calls), no torch."""

from __future__ import annotations

from pathlib import Path

from hook_socket_support import LineServer
from transformers import TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import CallbackHandler

from gpuwarden.hook import HookClient, StepHook
from gpuwarden.hook.transformers import GpuwardenCallback


def test_trainer_steps_reach_the_agent(tmp_path: Path) -> None:
    server = LineServer(tmp_path / "hook.sock")
    try:
        now = [0.0]
        hook = StepHook(
            interval=5.0, tracemalloc=False, client=HookClient(str(server.path)), clock=lambda: now[0]
        )
        handler = CallbackHandler(  # type: ignore[no-untyped-call]  # transformers leaves it unannotated
            [GpuwardenCallback(hook)], model=None, processing_class=None, optimizer=None, lr_scheduler=None
        )
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
        state, control = TrainerState(), TrainerControl()
        for step in range(1, 8):
            state.global_step = step
            handler.on_step_end(args, state, control)
            now[0] += 1.0
        handler.on_train_end(args, state, control)
        conn = server.accept()
        assert [conn.message()["step"] for _ in range(3)] == [1, 6, 7]  # 0 s, 5 s, and the last
        assert conn.line() == b""  # the hook closed at the end of training
    finally:
        server.close()
