"""Train a CTR model (Criteo layout: 13 dense + 26 categorical features) with distributed tables.

One script, every role. Run it

- as a job of 2 pservers and 2 trainers on this machine:
  ``ps-launch --server_num 2 --worker_num 2 examples/train_ctr.py`` (add ``--async`` after the
  script for asynchronous updates);
- locally, as plain single-process PyTorch with ``nn.Embedding(sparse=True)`` (no TRAINING_ROLE
  set): ``python examples/train_ctr.py``, the baseline the benchmark compares with.

Data: by default each trainer generates its own examples from a planted logistic model (see
``ctr_data.py``; the Bayes-optimal AUC is about 0.80). ``--data PATH`` reads a Criteo-format
TSV instead (label, 13 integer columns, 26 hex columns, empty = missing): trainer k takes every
k-th of the first 90% of the lines, and the last 10% are the test set.

The model is Wide & Deep over two distributed tables that share the categorical ids (hashed
(slot, value) pairs, any int64): ``wide`` (dim 1, a learned weight per id) and ``deep`` (dim 16,
fed with the dense features to a 400-400-400 MLP). Tables train with Adagrad, the MLP with Adam.
With the defaults the job reaches a test AUC of at least 0.77 (``TARGET_AUC``); trainer 0 logs
it, saves the dense parameters (``--save``), saves the tables on the pservers (``--tables_dir``)
and exports them as one ids/rows file set per table (``--export_dir``).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import numpy as np
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctr_data  # noqa: E402

from transpiler import (DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv,  # noqa: E402
                        TableOptions)

TARGET_AUC = 0.77
DIM = 16
# Capacity hint for the distributed tables; ids are any int64 and may exceed it.
CAPACITY = 1 << 22
log = logging.getLogger("train_ctr")


class WideDeep(nn.Module):
    """logit = wide(ids).sum + MLP([deep(ids) flattened, dense features])."""

    def __init__(self, capacity: int = CAPACITY, dim: int = DIM, hidden=(400, 400, 400),
                 table_device: str = "cpu"):
        super().__init__()
        self.wide = nn.Embedding(capacity, 1, sparse=True, device=table_device)
        self.deep = nn.Embedding(capacity, dim, sparse=True, device=table_device)
        layers, width = [], ctr_data.N_SPARSE * dim + ctr_data.N_DENSE
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        self.mlp = nn.Sequential(*layers, nn.Linear(width, 1))

    def forward(self, dense: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        deep = self.deep(ids).flatten(1)
        return self.mlp(torch.cat([deep, dense], dim=1)).squeeze(1) + self.wide(ids).sum(dim=(1, 2))


def build_model(capacity: int = CAPACITY, table_device: str = "cpu") -> WideDeep:
    """The model; ``table_device="meta"`` allocates no memory for the embedding weights."""
    torch.manual_seed(0)  # every role builds the same initial dense weights
    return WideDeep(capacity, table_device=table_device)


TABLES = {"wide": TableOptions(optimizer="adagrad", optimizer_kwargs={"lr": 0.05}, init="zeros"),
          "deep": TableOptions(optimizer="adagrad", optimizer_kwargs={"lr": 0.05},
                               init="normal", init_kwargs={"std": 0.01})}


def build_program(lr: float = 1e-3) -> Program:
    """Dense MLP with Adam; both tables distributed, Adagrad (also for ``python -m transpiler show``).

    The tables are built on the meta device: their rows live on the pservers,
    so no role needs the ``capacity x dim`` weight ``nn.Embedding`` would allocate.
    """
    return Program(build_model(table_device="meta"), "adam", lr=lr, distributed_tables=TABLES)


def load_data(args, trainer_id: int, trainers: int):
    """(this trainer's training examples, the test examples)."""
    if args.data:
        everything = ctr_data.read_criteo_tsv(args.data, limit=args.limit)
        cut = int(0.9 * len(everything))
        train = everything.subset(np.arange(trainer_id, cut, trainers))
        return train, everything.subset(np.arange(cut, len(everything)))
    train = ctr_data.generate(args.train_examples // trainers, seed=args.seed,
                              sample_seed=1000 * args.seed + trainer_id + 1)
    test = ctr_data.generate(args.test_examples, seed=args.seed, sample_seed=1000 * args.seed + 999)
    return train, test


def batches(data: ctr_data.CtrData, batch_size: int, epoch: int, seed: int):
    """Shuffled (dense, ids, label) batches of one epoch, as tensors (the last partial one dropped)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(data))
    dense, ids, label = (torch.from_numpy(a) for a in (data.dense, data.ids, data.label))
    for start in range(0, len(order) - batch_size + 1, batch_size):
        pick = torch.from_numpy(order[start:start + batch_size])
        yield dense[pick], ids[pick], label[pick]


def evaluate(model: nn.Module, data: ctr_data.CtrData, batch_size: int = 8192) -> float:
    """Test AUC of ``model``."""
    model.eval()
    scores = []
    device = next(model.parameters()).device
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            part = data.subset(slice(start, start + batch_size))
            scores.append(model(torch.from_numpy(part.dense).to(device), torch.from_numpy(part.ids)).cpu())
    model.train()
    return ctr_data.auc(torch.cat(scores), data.label)


class Throughput:
    """Examples/s of the steps after ``warmup``; logged, and printed as a RESULT line for benchmarks."""

    def __init__(self, warmup: int, role: str):
        self.warmup, self.role = warmup, role
        self.steps = self.examples = 0
        self.start = self.end = None

    def step(self, n: int) -> None:
        self.steps += 1
        if self.steps == self.warmup:
            self.start = time.time()
        elif self.steps > self.warmup:
            self.examples += n
            self.end = time.time()

    def report(self) -> None:
        if self.start is None or self.end is None:
            return
        rate = self.examples / max(self.end - self.start, 1e-9)
        log.info("%s: %d timed examples in %.2f s: %.0f examples/s", self.role, self.examples,
                 self.end - self.start, rate)
        print("RESULT " + json.dumps({"role": self.role, "examples": self.examples, "start": self.start,
                                      "end": self.end}), flush=True)


def progress(total: int, enabled: bool, batch_size: int):
    """A tqdm bar over steps that shows examples/s (of this process) and the loss."""
    from tqdm import tqdm

    return tqdm(total=total * batch_size, disable=not enabled, mininterval=2.0, unit="ex",
                unit_scale=True, file=sys.stderr, desc="train")


def train_local(args) -> float:
    """Plain single-process PyTorch: nn.Embedding(sparse=True) with Adagrad, Adam on the MLP."""
    train, test = load_data(args, 0, 1)
    capacity = args.local_capacity
    model = build_model(capacity)
    with torch.no_grad():
        model.wide.weight.zero_()
        model.deep.weight.normal_(0, 0.01)
    tables = [model.wide.weight, model.deep.weight]
    dense = [p for n, p in model.named_parameters() if not n.startswith(("wide.", "deep."))]
    opts = [torch.optim.Adam(dense, lr=args.lr), torch.optim.Adagrad(tables, lr=0.05)]
    speed = Throughput(args.warmup, "local")
    loss_fn = nn.BCEWithLogitsLoss()
    steps_per_epoch = len(train) // args.batch_size
    with progress(args.epochs * steps_per_epoch, args.progress, args.batch_size) as bar:
        for epoch in range(args.epochs):
            for dense_x, ids, y in batches(train, args.batch_size, epoch, args.seed):
                if args.steps and speed.steps >= args.steps:
                    break
                for o in opts:
                    o.zero_grad()
                loss = loss_fn(model(dense_x, ids.remainder(capacity)), y)
                loss.backward()
                for o in opts:
                    o.step()
                speed.step(len(y))
                bar.update(len(y))
    speed.report()
    test.ids = np.remainder(test.ids, capacity)
    return evaluate(model, test)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--async", dest="sync_mode", action="store_false", help="asynchronous updates")
    p.add_argument("--data", help="Criteo-format TSV file (default: generated data)")
    p.add_argument("--limit", type=int, help="with --data: read at most this many lines")
    p.add_argument("--train_examples", type=int, default=1_000_000, help="generated, all trainers together")
    p.add_argument("--test_examples", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    p.add_argument("--batch_size", type=int, default=1024, help="per trainer")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's lr for the MLP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=10, help="steps before the throughput clock starts")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: 1 in a job, torch's default locally)")
    p.add_argument("--no_progress", dest="progress", action="store_false")
    p.add_argument("--target_auc", type=float, default=TARGET_AUC, help="exit 1 below this test AUC")
    p.add_argument("--save", default="ctr_dense.pt", help="trainer 0 saves the dense state_dict here")
    p.add_argument("--tables_dir", default="ctr_tables", help="pservers save the table shards here")
    p.add_argument("--export_dir", default="ctr_export", help="trainer 0 exports ids/rows files here")
    p.add_argument("--no_save", dest="save_model", action="store_false",
                   help="skip saving and exporting (benchmarks)")
    p.add_argument("--local_capacity", type=int, default=1 << 21,
                   help="local run: rows of the dense nn.Embedding (ids taken modulo this)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = RoleEnv.from_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    elif env is not None:
        torch.set_num_threads(1)  # several roles share this machine's cores
    if env is None:
        score = train_local(args)
        log.info("local run: test AUC %.4f (target %.2f)", score, args.target_auc)
        return 0 if score >= args.target_auc else 1

    # Async: overlap each step's push with the next forward/backward (Adam and Adagrad take
    # the extra step of staleness well; the AUC matches sync mode).
    t = DistributeTranspiler(DistributeTranspilerConfig(async_pipeline=True))
    t.transpile(env.trainer_id, program=build_program(args.lr), pservers=env.pserver_list,
                trainers=env.trainers, sync_mode=args.sync_mode)
    if env.is_pserver:
        from pserver import ParameterServer

        ps_program = t.get_pserver_program(env.current_endpoint)
        ParameterServer(ps_program, t.get_startup_program(env.current_endpoint, ps_program)).serve()
        return 0

    from trainer import Trainer

    # Every process reads its own shard: a trainer node of L processes reads L of them.
    shard, shards = env.trainer_id * env.local_world_size + env.local_rank, env.trainers * env.local_world_size
    train, test = load_data(args, shard, shards)
    role = f"trainer {env.trainer_id}" + (f" local rank {env.local_rank}" if env.local_world_size > 1 else "")
    leader = env.trainer_id == 0 and env.local_rank == 0
    log.info("%s: %d training examples, %d test examples", role, len(train), len(test))
    loss_fn = nn.BCEWithLogitsLoss()
    speed = Throughput(args.warmup, role)
    steps_per_epoch = len(train) // args.batch_size
    # Every trainer runs the same number of steps, so sync barriers never wait for a finished one.
    total = args.epochs * steps_per_epoch if not args.steps else min(args.steps, args.epochs * steps_per_epoch)
    with Trainer(t.get_trainer_program()) as tr, \
            progress(total, args.progress and leader, args.batch_size) as bar:
        for epoch in range(args.epochs):
            epoch_batches = batches(train, args.batch_size, epoch, args.seed + shard)
            upcoming = next(epoch_batches, None)
            while upcoming is not None and speed.steps < total:
                dense_x, ids, y = upcoming
                upcoming = next(epoch_batches, None)  # one batch ahead: its ids ride with this step's push
                # Both tables in one round trip per pserver; after the first step their rows came with
                # the last step's answer already, and this asks nothing.
                tr.prefetch({"wide": ids, "deep": ids})
                # ids stay on the CPU (deduplicated and routed there); the rest goes to the trainer's device
                loss = loss_fn(tr.model(dense_x.to(tr.device), ids), y.to(tr.device))
                loss.backward()
                ahead = upcoming is not None and speed.steps + 1 < total
                tr.step(prefetch={"wide": upcoming[1], "deep": upcoming[1]} if ahead else None)
                speed.step(len(y))
                bar.update(len(y))
                if speed.steps % 50 == 0:
                    bar.set_postfix(loss=f"{loss.item():.4f}")
        speed.report()
        if env.trainer_id != 0:
            return 0
        score = evaluate(tr.model, test)
        log.info("%s: test AUC %.4f after %d steps (%s mode, target %.2f)", role, score, speed.steps,
                 "sync" if args.sync_mode else "async", args.target_auc)
        if not args.save_model:
            return 0 if score >= args.target_auc else 1
        # Every local rank of node 0 calls these (on a node they are collectives); its leader writes.
        state = tr.state_dict()
        paths = tr.save_tables(os.path.abspath(args.tables_dir))
        if not leader:
            return 0 if score >= args.target_auc else 1
        torch.save(state, args.save)
        log.info("%s: dense state_dict saved to %s, table shards to %s", role, args.save, paths)
    from pserver.tables.files import export_tables

    for table, meta in export_tables(args.tables_dir, args.export_dir).items():
        log.info("exported table %s: %d rows to %s", table, meta["rows"], args.export_dir)
    return 0 if score >= args.target_auc else 1


if __name__ == "__main__":
    sys.exit(main())
