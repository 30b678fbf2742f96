"""The hook's Lightning callback on a real GPU: a Lightning Trainer's steps reach a socket as readings
of torch's allocator, under the GPU's UUID as NVML (nvidia-smi) spells it.

Run on a GPU machine, never in CI; needs torch and lightning (the H200 image has both; elsewhere
``pip install torch lightning``):

    PYTHONPATH=. python3 -m pytest -m gpu tests/gpu/test_hook_lightning_gpu.py
"""

from __future__ import annotations

import json
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.hook import HookClient, StepHook

pytestmark = pytest.mark.gpu

STEPS = 20


def nvidia_smi_uuid() -> str:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_lightning_steps_arrive_with_the_allocators_figures(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    import torch

    from gpuwarden.hook.lightning import GpuwardenCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(1024, 1024)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.net(batch[0]).square().mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    path = tmp_path / "hook.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)  # the client's connect completes in the backlog; lines wait in the buffer
    server.settimeout(30)
    hook = StepHook(interval=0.0, tracemalloc=False, client=HookClient(str(path)))
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(STEPS * 8, 1024)), batch_size=8
    )
    trainer = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GpuwardenCallback(hook)],
    )
    trainer.fit(Tiny(), data)

    conn, _ = server.accept()
    conn.settimeout(30)
    messages = [json.loads(line) for line in conn.makefile("rb")]
    assert [m["step"] for m in messages] == [*range(1, STEPS + 1), STEPS]  # each step, then the last
    uuid = nvidia_smi_uuid()
    for message in messages:
        (device,) = message["devices"]
        assert device["uuid"] == uuid
        assert 0 < device["allocatedBytes"] <= device["reservedBytes"]
        assert device["maxAllocatedBytes"] >= device["allocatedBytes"]
        assert message["hostRssBytes"] > 0
