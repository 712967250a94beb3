"""Job D of the peer comparison on this project's collective mode (DDP through our Trainer).

    PYTHONPATH=. ps-launch --worker_num 2 benchmarks/jobs/job_d_collective.py    # from the repository root

The job exactly as ``shared/peers/torch_peers.py ddp-dense`` runs it (its peer): the MLP
512-2048-2048-2048-10 seeded as there, SGD lr 0.01, cross-entropy, batch 256 per process,
process ``r`` at step ``t`` trains on ``jobs.dense_batch(t, r, 256)``, 5 warm-up + 30 timed steps,
one torch thread per process, gloo. The difference is the path: ``Program`` ->
``DistributeTranspiler(mode="collective")`` -> ``Trainer`` (a ``CollectiveTrainer``) and its
``tr.step()``, what a user of this project writes. ``python -m benchmarks.bench_peers`` runs it as
``D:ours-collective`` next to ``D:ddp`` and reads the ``RESULT`` line of process 0: samples/s
over all processes, the slowest process's time of the timed steps, as the peer measures.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv

log = logging.getLogger("job_d_collective")


def make_model(jobs, seed: int = 0) -> nn.Sequential:
    """The peers' job D model, seeded as ``torch_peers.make_dense_model`` seeds it."""
    torch.manual_seed(seed)
    s = jobs.D_SIZES
    layers = []
    for i in range(len(s) - 1):
        layers.append(nn.Linear(s[i], s[i + 1]))
        if i < len(s) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--peers", default=DEFAULT_PEERS, help="folder of the peers' jobs.py (default: %(default)s)"
    )
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: jobs.D_WARMUP)")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: jobs.D_STEPS)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = RoleEnv.from_env()
    if env is None or not env.collective:
        print(
            "job_d_collective.py runs as a collective job: PYTHONPATH=. ps-launch --worker_num 2 "
            "benchmarks/jobs/job_d_collective.py",
            file=sys.stderr,
        )
        return 2
    jobs = peer_module(args.peers, "jobs")
    warmup = jobs.D_WARMUP if args.warmup is None else args.warmup
    steps = jobs.D_STEPS if args.steps is None else args.steps
    torch.set_num_threads(1)  # as the peer: one thread per process
    t = DistributeTranspiler(DistributeTranspilerConfig(mode="collective"))
    t.transpile(
        env.trainer_id,
        program=Program(make_model(jobs, args.seed), "sgd", lr=jobs.D_LR),
        pservers=None,
        trainers=env.trainers,
    )
    from trainer import Trainer

    loss_fn = nn.CrossEntropyLoss()
    with Trainer(t.get_trainer_program()) as tr:
        rank, world = dist.get_rank(), dist.get_world_size()
        batches = []
        for step in range(warmup + steps):
            x, y = jobs.dense_batch(step, rank, jobs.D_BATCH_PER_TRAINER, args.seed)
            batches.append((torch.from_numpy(x), torch.from_numpy(y)))
        losses = []
        dist.barrier()
        for i, (x, y) in enumerate(batches):
            if i == warmup:
                dist.barrier()
                t0 = time.perf_counter()
            loss = loss_fn(tr.model(x), y)
            loss.backward()
            tr.step()
            losses.append(loss.item())
        elapsed = time.perf_counter() - t0
        times = [None] * world
        dist.all_gather_object(times, elapsed)
        if rank == 0:
            slowest = max(times)
            print(
                "RESULT "
                + json.dumps(
                    {
                        "samples_per_s": steps * jobs.D_BATCH_PER_TRAINER * world / slowest,
                        "procs": world,
                        "steps": steps,
                        "per_rank_s": [round(s, 3) for s in times],
                        "first_loss": losses[0],
                        "last_loss": losses[-1],
                        "torch_threads": torch.get_num_threads(),
                    }
                ),
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
