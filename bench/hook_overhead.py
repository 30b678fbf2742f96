"""Per-step overhead of the training hook (gpuwarden.hook.StepHook), tracemalloc off and on.

Not a test: it prints figures for docs/benchmarks.md ("Training hook overhead"). One process
times, side by side in alternating blocks, the same training step with no hook, with a hook
(tracemalloc off) and with a hook (tracemalloc on, at each ``--frames`` depth), each hook reading
at its real interval and sending to a Unix socket that a thread here drains (as the agent would).
It then times one reading of each hook on its own (what a step that reads pays).

    python3 bench/hook_overhead.py                              # CPU step: Python work + C work
    python3 bench/hook_overhead.py --compute-mib 0 --tokens 4000  # pure Python: tracemalloc's worst
    python3 bench/hook_overhead.py --torch-cuda                 # on a GPU machine: a torch step

tracemalloc costs on every Python allocation, and more the deeper the stack it records: the ratio
depends on how much of a step is Python allocating (a GPU step mostly waits for kernels).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import socket
import statistics
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwarden.hook import HookClient, StepHook

BUFFER = bytes(2**20)


def cpu_step(rng: random.Random, tokens: int, compute_mib: int) -> float:
    """A step on the CPU: Python bookkeeping (tokenise a batch, pad it, a 'loss'), then
    ``compute_mib`` MiB of hashing, which stands for the kernels a GPU step waits for (C work that
    makes no Python allocation)."""
    for _ in range(compute_mib):
        hashlib.sha256(BUFFER).digest()
    text = [f"tok{rng.randrange(5000)}" for _ in range(tokens)]
    ids = [hash(word) % 50_000 for word in text]
    rows = [ids[i : i + 128] for i in range(0, len(ids), 128)]
    padded = [row + [0] * (128 - len(row)) for row in rows]
    batch = {"input_ids": padded, "attention_mask": [[int(t != 0) for t in row] for row in padded]}
    return sum(sum(row) for row in batch["input_ids"]) / (len(padded) * 128)


def torch_step_factory() -> Callable[[], float]:
    """A small torch training step on CUDA (for the GPU machine)."""
    import torch

    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)
    ).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> float:
        x = torch.randn(256, 1024, device="cuda")
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    return step


def drain(server: socket.socket) -> None:
    """Accept connections and read everything, as the agent does."""
    while True:
        try:
            conn, _ = server.accept()
        except OSError:
            return
        threading.Thread(target=discard, args=(conn,), daemon=True).start()


def discard(conn: socket.socket) -> None:
    while conn.recv(65536):
        pass


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="timed steps, all variants together")
    parser.add_argument("--block", type=int, default=200, help="steps per block")
    parser.add_argument("--tokens", type=int, default=1000, help="CPU step: tokens per batch")
    parser.add_argument("--compute-mib", type=int, default=16, help="CPU step: MiB hashed (the 'kernels')")
    parser.add_argument("--interval", type=float, default=5.0, help="the hooks' reading interval")
    parser.add_argument("--readings", type=int, default=50, help="single readings timed per hook")
    parser.add_argument(
        "--frames", type=lambda v: [int(f) for f in v.split(",")], default=[1, 8], help="tracemalloc depths"
    )
    parser.add_argument("--torch-cuda", action="store_true", help="a torch step on CUDA instead")
    args = parser.parse_args()

    sock_dir = tempfile.mkdtemp()
    path = os.path.join(sock_dir, "hook.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(4)
    threading.Thread(target=drain, args=(server,), daemon=True).start()

    rng = random.Random(0)
    step = torch_step_factory() if args.torch_cuda else (lambda: cpu_step(rng, args.tokens, args.compute_mib))
    variants: dict[str, StepHook | None] = {
        "no hook": None,
        "hook, tracemalloc off": StepHook(interval=args.interval, tracemalloc=False, client=HookClient(path)),
    }
    for frames in args.frames:
        hook = StepHook(interval=args.interval, tracemalloc=True, frames=frames, client=HookClient(path))
        assert hook.tracker is not None
        hook.tracker.stop()  # traced during its own blocks only, so the other variants run untraced
        variants[f"hook, tracemalloc {frames} fr"] = hook

    block: int = args.block

    def run_block(hook: StepHook | None) -> float:
        if hook is not None and hook.tracker is not None:
            hook.tracker.start()
        start = time.perf_counter()
        for _ in range(block):
            step()
            if hook is not None:
                hook.step()
        elapsed = time.perf_counter() - start
        if hook is not None and hook.tracker is not None:
            hook.tracker.stop()
        return elapsed / block

    per_step: dict[str, list[float]] = {name: [] for name in variants}
    for variant in variants.values():  # warm-up
        run_block(variant)
    deadline = time.monotonic() + args.seconds
    order = list(variants)
    while time.monotonic() < deadline:
        for name in order:
            per_step[name].append(run_block(variants[name]))
        order = order[1:] + order[:1]
    blocks = len(per_step["no hook"])
    print(f"{blocks} blocks of {args.block} steps per variant, reading every {args.interval:g} s")
    base = statistics.median(per_step["no hook"])
    for name, times in per_step.items():
        median = statistics.median(times)
        print(f"{name:26} {median * 1e3:9.3f} ms/step  {median / base:7.2f}x")

    # One reading each, unpaced (a clock that never moves): what a step that reads pays. In the timed
    # blocks above the tracker paces itself to its budget, so most readings there repeat the last sites.
    # Each hook is made just before its readings, so each traces only its own.
    single = [("hook, tracemalloc off", False, None)]
    single += [(f"hook, tracemalloc {frames} fr", True, frames) for frames in args.frames]
    for name, on, depth in single:
        hook = StepHook(tracemalloc=on, frames=depth, client=HookClient(path), clock=lambda: 0.0)
        costs = []
        for _ in range(args.readings):
            step()
            start = time.perf_counter()
            hook.send_now()
            costs.append(time.perf_counter() - start)
        traced = len(tracemalloc.take_snapshot().traces) if tracemalloc.is_tracing() else 0
        hook.close()
        print(
            f"one reading, {name:26} {statistics.median(costs) * 1e3:8.3f} ms "
            f"(median of {args.readings}; {traced} blocks traced at the end)"
        )
    server.close()


if __name__ == "__main__":
    main()
