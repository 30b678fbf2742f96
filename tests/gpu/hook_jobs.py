"""Torch training jobs for the hook's GPU tests, each a real loop on CUDA with a StepHook.

    python tests/gpu/hook_jobs.py leak  --socket /tmp/hook.sock --seconds 120
    python tests/gpu/hook_jobs.py cache --socket /tmp/hook.sock --seconds 120
    python tests/gpu/hook_jobs.py loader --socket /tmp/hook.sock --seconds 120
    python tests/gpu/hook_jobs.py trainer [--fixed] --socket /tmp/hook.sock --seconds 300
    python tests/gpu/hook_jobs.py lightning [--fixed] --socket /tmp/hook.sock --seconds 300

Each prints one JSON line once CUDA and the hook are up (``{"ready": true, "pid": …, "leakFile": …,
"leakLine": …}``), then trains at ``--steps-per-second`` until ``--seconds`` have passed.

- ``leak``: the classic leak. Each step trains properly, then "logs" a probe loss computed with
  autograd on and kept as a tensor (``history.append(...)`` instead of ``.item()`` under no_grad):
  every step keeps that forward pass's graph and its saved activations on the GPU, about 5 MiB a
  step: about 1.2 GiB a minute at 4 steps a second (1,199 MiB/min measured on the H200, where the
  loop keeps its pace with tracemalloc on; before the tracker forgot the set-up's traces and paced
  its readings, it made one step in 6 s).
  tracemalloc is on; the kept tensors' Python objects are made at the marked line, which the hook
  must name (as ``hook_jobs.py`` relative to the working directory when run from tests/gpu, else
  by its absolute path: compare the file's end).
- ``cache``: the same loop with the leak fixed, but the batch grows by ``--grow-rows`` every
  ``--grow-every`` seconds (a step's activations are about 40 KiB a row: 320 MiB more per growth
  at the defaults, about 1 GiB/min): the caching allocator's reserved memory (and NVML's figure)
  grows in steps while allocated memory after each step stays flat (the parameters).
- ``loader``: a DataLoader with ``--workers`` worker processes whose dataset keeps
  ``--leak-bytes-per-item`` of host memory per item it serves (a list growing in ``__getitem__``):
  the workers' RSS grows, GPU memory does not.
- ``trainer``: a real ``transformers.Trainer`` fine-tuning a small GPT-2 made from its config (no
  download), whose subclass overrides ``compute_loss`` to also keep a score of each batch: a
  ``logsumexp`` of the logits kept as a tensor, so each step keeps that step's logits (saved for the
  score's backward, which never runs): ``--sequences`` x ``--seq`` x ``--vocab`` x 4 bytes a step (16 MiB
  at 4 x 128 x 8192, about 3.75 GiB a minute at 4 steps a second). ``--fixed`` keeps ``.item()`` of
  the score instead. The GpuwardenCallback drives a StepHook at its defaults but for tracemalloc on.
- ``lightning``: the same model and leak in a ``LightningModule``'s ``training_step`` under a
  Lightning Trainer, with ``--fixed`` the same way.

``trainer`` and ``lightning`` take ``--snapshots DIR`` (the hook opts in to the agent's requests,
snapshots into DIR), ``--ballast-free-gib N`` (one allocation leaves N GiB of the card free, so a leak
reaches the OOM in minutes) and ``--no-tracemalloc``; their ready line also names ``forwardLine``,
the line whose forward pass allocates the logits the leak keeps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run from a checkout, installed or not

from gpuwarden.hook import HookClient, StepHook  # noqa: E402

WIDTH = 1024


def marker_line(tag: str) -> int:
    """The line of this file that ends with ``# hook-jobs: <tag>``."""
    lines = Path(__file__).read_text().splitlines()
    return next(n for n, text in enumerate(lines, 1) if text.rstrip().endswith(f"# hook-jobs: {tag}"))


def _model() -> Any:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 4 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(4 * WIDTH, WIDTH)
    ).cuda()


def _ready(**extra: object) -> None:
    print(json.dumps({"ready": True, "pid": os.getpid(), **extra}), flush=True)


class Pace:
    """Sleeps so that steps run at ``per_second`` until ``seconds`` have passed; says on stderr every
    ``report_every`` seconds how many steps it made (a job the hook slows falls behind its pace)."""

    def __init__(self, seconds: float, per_second: float, report_every: float = 30.0) -> None:
        self.period = 1.0 / per_second
        self.start = time.monotonic()
        self.deadline = self.start + seconds
        self.steps = 0
        self.report_every = report_every
        self._reported = self.start

    def next(self) -> bool:
        self.steps += 1
        now = time.monotonic()
        if now - self._reported >= self.report_every:
            self._reported = now
            elapsed = now - self.start
            progress = {"steps": self.steps, "seconds": round(elapsed, 1)}
            print(json.dumps({**progress, "stepsPerSecond": round(self.steps / elapsed, 2)}), file=sys.stderr)
        wait = self.start + self.steps * self.period - now
        if wait > 0:
            time.sleep(wait)
        return time.monotonic() < self.deadline


def _train_step(model: Any, opt: Any, batch: int) -> None:
    import torch

    x = torch.randn(batch, WIDTH, device="cuda")
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def leak(args: argparse.Namespace) -> None:
    """The classic leak: a probe loss kept with its graph every step (tracemalloc on)."""
    import torch

    hook = StepHook(interval=args.interval, tracemalloc=True, client=HookClient(args.socket))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    probe = torch.randn(args.probe_batch, WIDTH, device="cuda")
    history = []
    torch.cuda.synchronize()
    _ready(leakFile=str(Path(__file__).resolve()), leakLine=marker_line("leak"))
    pace = Pace(args.seconds, args.steps_per_second)
    while True:
        _train_step(model, opt, args.batch)
        history.append(model(probe).square().mean())  # hook-jobs: leak
        torch.cuda.synchronize()
        hook.step()
        if not pace.next():
            break
    hook.close()


def cache(args: argparse.Namespace) -> None:
    """The leak fixed; the batch grows in steps, so the allocator's cache grows and allocated does not."""
    import torch

    hook = StepHook(interval=args.interval, tracemalloc=True, client=HookClient(args.socket))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    probe = torch.randn(args.probe_batch, WIDTH, device="cuda")
    torch.cuda.synchronize()
    _ready()
    pace = Pace(args.seconds, args.steps_per_second)
    while True:
        grown = int((time.monotonic() - pace.start) // args.grow_every)
        _train_step(model, opt, args.batch + args.grow_rows * grown)
        with torch.no_grad():
            model(probe).square().mean().item()  # logged, the fixed way
        hook.step()
        if not pace.next():
            break
    hook.close()


class LeakyDataset:
    """Random samples; keeps ``leak_bytes`` per item served, in the worker that served it."""

    def __init__(self, leak_bytes: int) -> None:
        self.leak_bytes = leak_bytes
        self.kept: list[bytes] = []

    def __len__(self) -> int:
        return 10**9

    def __getitem__(self, index: int) -> Any:
        import torch

        self.kept.append(b"\x01" * self.leak_bytes)  # written, so resident
        return torch.randn(WIDTH)


def loader(args: argparse.Namespace) -> None:
    """Data-loader workers leak host memory; the GPU loop itself is clean."""
    import torch
    from torch.utils.data import DataLoader

    hook = StepHook(interval=args.interval, tracemalloc=False, client=HookClient(args.socket))
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    data = DataLoader(
        LeakyDataset(args.leak_bytes_per_item),
        batch_size=args.batch,
        num_workers=args.workers,
        persistent_workers=True,
    )
    batches = iter(data)
    torch.cuda.synchronize()
    _ready(workers=args.workers)
    pace = Pace(args.seconds, args.steps_per_second)
    while True:
        x = next(batches).cuda(non_blocking=True)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        hook.step()
        if not pace.next():
            break
    hook.close()


def _gpt2(args: argparse.Namespace) -> Any:
    """A small GPT-2 from its config (4 layers of 256), on no device yet."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=4, n_head=4, n_embd=256, vocab_size=args.vocab, n_positions=args.seq)
    return GPT2LMHeadModel(config)


def _tokens(args: argparse.Namespace, items: int) -> Any:
    """``items`` random sequences of ``--seq`` token ids."""
    import torch

    return torch.randint(0, args.vocab, (items, args.seq))


def _hook(args: argparse.Namespace) -> StepHook:
    return StepHook(
        interval=args.interval,
        tracemalloc=not args.no_tracemalloc,
        client=HookClient(args.socket),
        snapshots=args.snapshots or False,
    )


def _ballast(args: argparse.Namespace) -> Any:
    """With ``--ballast-free-gib``: one allocation that leaves that much of the card free, so that a
    leak reaches the OOM in minutes (kept referenced for the job's life)."""
    if args.ballast_free_gib is None:
        return None
    import torch

    free, _ = torch.cuda.mem_get_info()
    size = free - int(args.ballast_free_gib * 2**30)
    return torch.empty(max(size, 0), dtype=torch.uint8, device="cuda") if size > 0 else None


def trainer(args: argparse.Namespace) -> None:
    """A transformers.Trainer whose compute_loss override keeps a score with its graph each step."""
    import tempfile

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gpuwarden.hook.transformers import GpuwardenCallback

    class ScoringTrainer(Trainer):
        """Logs a score of each batch; the leaking version keeps it as a tensor, with its graph."""

        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.scores: list[Any] = []
            self.total = 0.0

        def compute_loss(
            self, model: Any, inputs: Any, return_outputs: bool = False, num_items_in_batch: Any = None
        ) -> Any:
            outputs = model(**inputs)  # hook-jobs: trainer-forward
            if args.fixed:
                self.total += outputs.logits.detach().logsumexp(-1).mean().item()
            else:
                self.scores.append(outputs.logits.logsumexp(-1).mean())  # hook-jobs: trainer-leak
            return (outputs.loss, outputs) if return_outputs else outputs.loss

    class Paced(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            control.should_training_stop = not pace.next()

    ids = _tokens(args, 4096)
    data = [{"input_ids": row, "labels": row} for row in ids]
    out = tempfile.mkdtemp(prefix="hook-jobs-trainer-")
    targs = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=args.sequences,
        max_steps=10**9,
        learning_rate=1e-4,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    hook = _hook(args)
    ballast = _ballast(args)  # noqa: F841 (held)
    job = ScoringTrainer(
        model=_gpt2(args),
        args=targs,
        train_dataset=data,
        callbacks=[GpuwardenCallback(hook), Paced()],
    )
    _ready(
        leakFile=str(Path(__file__).resolve()),
        leakLine=marker_line("trainer-leak"),
        forwardLine=marker_line("trainer-forward"),
    )
    pace = Pace(args.seconds, args.steps_per_second)
    job.train()


def lightning(args: argparse.Namespace) -> None:
    """A LightningModule whose training_step keeps a score with its graph each step."""
    import lightning.pytorch as pl
    import torch

    from gpuwarden.hook.lightning import GpuwardenCallback

    class Scoring(pl.LightningModule):
        """Logs a score of each batch; the leaking version keeps it as a tensor, with its graph."""

        def __init__(self) -> None:
            super().__init__()
            self.model = _gpt2(args)
            self.scores: list[Any] = []
            self.total = 0.0

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            outputs = self.model(input_ids=batch, labels=batch)  # hook-jobs: lightning-forward
            if args.fixed:
                self.total += outputs.logits.detach().logsumexp(-1).mean().item()
            else:
                self.scores.append(outputs.logits.logsumexp(-1).mean())  # hook-jobs: lightning-leak
            return outputs.loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Paced(pl.Callback):
        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, i: int) -> None:
            if not pace.next():
                trainer.should_stop = True

    data = torch.utils.data.DataLoader(_tokens(args, 4096), batch_size=args.sequences, shuffle=True)
    hook = _hook(args)
    ballast = _ballast(args)  # noqa: F841 (held)
    job = pl.Trainer(
        accelerator="gpu",
        devices=1,
        max_epochs=10**6,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[GpuwardenCallback(hook), Paced()],
    )
    _ready(
        leakFile=str(Path(__file__).resolve()),
        leakLine=marker_line("lightning-leak"),
        forwardLine=marker_line("lightning-forward"),
    )
    pace = Pace(args.seconds, args.steps_per_second)
    job.fit(Scoring(), data)


def main(argv: list[str] | None = None) -> None:
    """Run one job (see the module doc)."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("job", choices=["leak", "cache", "loader", "trainer", "lightning"])
    parser.add_argument("--socket", required=True, help="the agent's hook socket")
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--steps-per-second", type=float, default=4.0)
    parser.add_argument("--interval", type=float, default=1.0, help="the hook's reading interval")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--probe-batch", type=int, default=256, help="leak: the kept probe's batch")
    parser.add_argument("--grow-every", type=float, default=20.0, help="cache: seconds per batch growth")
    parser.add_argument("--grow-rows", type=int, default=8192, help="cache: rows the batch grows by")
    parser.add_argument("--workers", type=int, default=2, help="loader: data-loader workers")
    parser.add_argument("--leak-bytes-per-item", type=int, default=64 * 1024, help="loader: kept per item")
    parser.add_argument("--fixed", action="store_true", help="trainer, lightning: the leak fixed")
    parser.add_argument("--sequences", type=int, default=4, help="trainer, lightning: sequences a batch")
    parser.add_argument("--vocab", type=int, default=8192, help="trainer, lightning: GPT-2's vocabulary")
    parser.add_argument("--seq", type=int, default=128, help="trainer, lightning: tokens a sequence")
    parser.add_argument(
        "--snapshots",
        help="trainer, lightning: opt in to the agent's requests, snapshots into this directory",
    )
    parser.add_argument(
        "--ballast-free-gib", type=float, help="trainer, lightning: allocate all of the card but this much"
    )
    parser.add_argument("--no-tracemalloc", action="store_true", help="trainer, lightning: tracemalloc off")
    args = parser.parse_args(argv)
    jobs = {"leak": leak, "cache": cache, "loader": loader, "trainer": trainer, "lightning": lightning}
    jobs[args.job](args)


if __name__ == "__main__":
    main()
