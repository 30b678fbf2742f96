"""A ``transformers.TrainerCallback`` that drives a :class:`~gpuwarden.hook.StepHook`::

    from gpuwarden.hook.transformers import GpuwardenCallback
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[GpuwardenCallback()])

Every process of a distributed run reports its own GPU (the Trainer calls callbacks on each rank).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from gpuwarden.hook.step import StepHook


class GpuwardenCallback(TrainerCallback):
    """Counts the Trainer's steps into ``hook`` (a default :class:`StepHook` unless given)."""

    def __init__(self, hook: StepHook | None = None) -> None:
        self.hook = hook if hook is not None else StepHook()

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After each optimizer step: the hook reads when its interval has passed."""
        self.hook.step(state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A last reading, then the hook lets go of its socket and tracing."""
        self.hook.close()
