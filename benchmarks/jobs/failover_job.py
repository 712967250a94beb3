"""The job of the failover benchmark (``bench_failover.py``): one script, every role, sync, until told to
stop.

An MLP (32-512-4, momentum SGD) trained by 2 trainers on seeded random batches, one step after another,
until OUT_DIR/stop exists. Each trainer appends one line per step to OUT_DIR/steps-<id>.jsonl: ``{"step",
"start", "end"}`` (``time.time()``, the whole iteration: forward, backward and ``Trainer.step()``), which
is what a user sees stall while a pserver is lost. The pservers are replicated or not as the environment
says (ps-launch's variables).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import torch
from torch import nn

from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv


def program() -> Program:
    torch.manual_seed(0)
    return Program(
        nn.Sequential(nn.Linear(32, 512), nn.Tanh(), nn.Linear(512, 4)), "momentum", lr=0.05, momentum=0.9
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out_dir", required=True)
    p.add_argument("--checkpoint_dir", default=None)
    p.add_argument("--checkpoint_every", type=int, default=20)
    p.add_argument(
        "--step_delay", type=float, default=0.02, help="seconds between steps (a data pipeline's pace)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    env = RoleEnv.from_env()
    config = DistributeTranspilerConfig(
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every if args.checkpoint_dir else 0,
        heartbeat_interval=0.5,
        barrier_timeout=120.0,
        recovery_timeout=120.0,
    )
    t = DistributeTranspiler(config)
    t.transpile(env.trainer_id, program=program(), pservers=env.pserver_list, trainers=env.trainers)
    if env.is_pserver:
        from pserver import ParameterServer

        prog = t.get_pserver_program(env.current_endpoint)
        ParameterServer(prog, t.get_startup_program(env.current_endpoint, prog)).serve()
        return 0
    from trainer import Trainer

    tr = Trainer(t.get_trainer_program())
    stop = os.path.join(args.out_dir, "stop")
    with open(os.path.join(args.out_dir, f"steps-{env.trainer_id}.jsonl"), "a") as out:
        while not os.path.exists(stop):
            step = tr.step_count
            g = torch.Generator().manual_seed(step * 1000 + env.trainer_id)
            x, y = torch.randn(64, 32, generator=g), torch.randint(0, 4, (64,), generator=g)
            start = time.time()
            nn.functional.cross_entropy(tr.model(x), y).backward()
            tr.step()
            out.write(json.dumps({"step": step, "start": start, "end": time.time()}) + "\n")
            out.flush()
            time.sleep(args.step_delay)
    tr.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
