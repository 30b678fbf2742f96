"""A PyTorch Lightning callback (``lightning.pytorch``, Lightning 2) that drives a :class:`StepHook`::

    from gpuwarden.hook.lightning import GpuwardenCallback
    trainer = lightning.pytorch.Trainer(max_epochs=3, callbacks=[GpuwardenCallback()])

Every process of a distributed run reports its own GPU.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from gpuwarden.hook.step import StepHook


class GpuwardenCallback(Callback):
    """Counts Lightning's global steps into ``hook`` (a default :class:`StepHook` unless given)."""

    def __init__(self, hook: StepHook | None = None) -> None:
        self.hook = hook if hook is not None else StepHook()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After each training batch: the hook reads when its interval has passed."""
        self.hook.step(trainer.global_step)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A last reading, then the hook lets go of its socket and tracing."""
        self.hook.close()
