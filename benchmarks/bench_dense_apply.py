"""The CPU of one pserver's dense work per push: per-block torch optimizer against the flat store.

Usage::

    python -m benchmarks.bench_dense_apply [--rounds 7] [--applies 300] [--peers DIR]

One pserver of job S (the MLP 429-256-128-1 of ``jobs/job_s.py``, 2 pservers, the default
transpiler config) holds its blocks in this process, one torch thread. Timed (this thread's CPU),
alternating round by round, medians of ``--rounds``, per apply:

- ``per-block``: what the store did before: a leaf tensor per block, ``torch.optim`` over them, each
  gradient set as ``.grad``, the step's lr set, ``step()``;
- ``flat``: :meth:`pserver.store.BlockStore.apply_flat` with one flat gradient (one functional call);
- ``by name``: :meth:`pserver.store.BlockStore.apply` with gradients by block name (the gRPC path: one
  functional call over the blocks' views);

for the job's SGD and for Adam on the same blocks; and a sync step's dense sums of 2 pushes and their
mean: per block in float32 (before) against :class:`pserver.flat.DenseSums`.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, Dict, List

import numpy as np
import torch

from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from benchmarks.jobs.job_s_program import build_program
from pserver.store import BlockStore
from transpiler import DistributeTranspiler, DistributeTranspilerConfig
from transpiler.optim import LrSchedule

PSERVERS = ["127.0.0.1:1", "127.0.0.1:2"]


class PerBlock:
    """The store's dense update as it was: torch's optimizer over one leaf tensor per block."""

    def __init__(self, store: BlockStore, spec):
        self.blocks = {n: b.detach().clone().requires_grad_(True) for n, b in store.blocks.items()}
        self.optimizer = spec.build(self.blocks.values())
        self.schedule = LrSchedule(spec)

    def apply(self, grads: Dict[str, torch.Tensor], step: int) -> None:
        lr = self.schedule.lr_at(step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        for name, g in grads.items():
            self.blocks[name].grad = g
        self.optimizer.step()
        for name in grads:
            self.blocks[name].grad = None


def pserver_store(jobs, optimizer: str):
    """Pserver 0's BlockStore of job S (its optimizer replaced by ``optimizer``) and its optimizer spec."""
    prog = build_program(jobs)
    if optimizer != "sgd":
        from transpiler.optim import OptimizerSpec

        prog.optimizer = OptimizerSpec(optimizer, {"lr": 1e-3})
    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(0, program=prog, pservers=",".join(PSERVERS), trainers=2, sync_mode=True)
    ps = t.get_pserver_program(PSERVERS[0])
    return BlockStore(ps, t.get_startup_program(PSERVERS[0], ps)), ps.optimizer


def cpu_per_call(fn: Callable[[int], None], n: int) -> float:
    """This thread's CPU per call of ``fn`` over ``n`` calls, in microseconds."""
    start = time.thread_time_ns()
    for i in range(n):
        fn(i)
    return (time.thread_time_ns() - start) / n / 1e3


def alternate(ways: Dict[str, Callable[[int], None]], rounds: int, n: int) -> Dict[str, float]:
    """Median over ``rounds`` of each way's CPU per call, the ways alternating within each round."""
    runs: Dict[str, List[float]] = {k: [] for k in ways}
    for fn in ways.values():
        cpu_per_call(fn, max(1, n // 10))  # warm
    for _ in range(rounds):
        for name, fn in ways.items():
            runs[name].append(cpu_per_call(fn, n))
    return {k: statistics.median(v) for k, v in runs.items()}


def apply_ways(jobs, optimizer: str):
    store, spec = pserver_store(jobs, optimizer)
    old = PerBlock(store, spec)
    layout = store.flat_layout
    rng = np.random.default_rng(0)
    flat = layout.zeros()
    named = {}
    for i, name in enumerate(layout.names):
        g = torch.from_numpy(rng.standard_normal(layout.shapes[i]).astype(np.float32) * 1e-3)
        layout.view(i, flat).copy_(g)
        named[name] = g
    ways = {
        "per-block": lambda s: old.apply(named, s),
        "flat": lambda s: store.apply_flat(flat, None, s),
        "by name": lambda s: store.apply(named, s),
    }
    return ways, store


def sum_ways(store: BlockStore):
    layout = store.flat_layout
    rng = np.random.default_rng(1)
    pushes = []
    for _ in range(2):
        flat = torch.from_numpy(rng.standard_normal(layout.numel).astype(np.float32))
        pushes.append((flat, {n: layout.view(i, flat) for i, n in enumerate(layout.names)}))
    sums = store.dense_sums()
    buffers: Dict[str, torch.Tensor] = {}

    def per_block(_):  # PendingStep before: copy the first push, add the next, divide in place
        for k, (_, named) in enumerate(pushes):
            for name, g in named.items():
                if k == 0:
                    buffers.setdefault(name, torch.empty_like(g)).copy_(g)
                else:
                    buffers[name].add_(g)
        {name: b.div_(2) for name, b in buffers.items()}

    def flat(_):
        for g, _ in pushes:
            sums.add_flat(g)
        sums.mean(2)
        sums.clear()

    return {"per-block float32": per_block, "flat float64": flat}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--applies", type=int, default=300, help="applies per way per round")
    p.add_argument("--peers", default=DEFAULT_PEERS, help="the peers' folder (its jobs.py defines job S)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # as a pserver (pserver_torch_threads)
    jobs = peer_module(args.peers, "jobs")
    for optimizer in ("sgd", "adam"):
        ways, store = apply_ways(jobs, optimizer)
        layout = store.flat_layout
        print(
            f"job S pserver 0, {optimizer}: {len(layout)} blocks, {layout.numel} elements "
            f"({layout.dense.nbytes / 1e6:.2f} MB flat)"
        )
        for name, us in alternate(ways, args.rounds, args.applies).items():
            print(f"  apply {name:<14} {us:8.1f} us CPU")
    for name, us in alternate(sum_ways(store), args.rounds, args.applies).items():
        print(f"  sync sums of 2 pushes + mean, {name:<18} {us:8.1f} us CPU")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
