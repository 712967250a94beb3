"""Train a CTR model (Criteo layout: 13 dense + 26 categorical features) with distributed tables.

One script, every role. Run it

- as a job of 2 pservers and 2 trainers on this machine:
  ``ps-launch --server_num 2 --worker_num 2 examples/train_ctr.py`` (add ``--async`` after the
  script for asynchronous updates);
- locally, as plain single-process PyTorch with ``nn.Embedding(sparse=True)`` (no TRAINING_ROLE
  set): ``python examples/train_ctr.py``, the baseline the benchmark compares with.

Data: every trainer streams its own shard, batch by batch, through a ``DataLoader`` over
``ctr_stream.CtrStream`` (an ``IterableDataset``); no process holds the whole data set. By
default the examples are drawn from a planted logistic model (see ``ctr_data.py``; the
Bayes-optimal AUC is about 0.80). ``--data PATH`` reads a Criteo-format TSV instead (label, 13
integer columns, 26 hex columns, empty = missing): trainer k of n parses only lines k, k + n,
k + 2n, ... of the first 90%, and the last 10% are the test set (or ``--test_data PATH``).
``--workers N`` reads with N DataLoader processes per trainer. Every epoch reads the same batches
in the same order, so ``tr.batches`` resumes a restarted trainer at its exact batch.

The model is Wide & Deep over two distributed tables that share the categorical ids (hashed
(slot, value) pairs, any int64): ``wide`` (dim 1, a learned weight per id) and ``deep`` (dim 16,
fed with the dense features to a 400-400-400 MLP). Tables train with Adagrad, the MLP with Adam.
With the defaults the job reaches a test AUC of at least 0.77 (``TARGET_AUC``); trainer 0 saves
the dense parameters (``--save``), saves the tables on the pservers (``--tables_dir``), exports
them as one ids/rows file set per table (``--export_dir``), and prints the test AUC (scikit-learn's
``roc_auc_score``) last: ``trainer 0: test AUC 0.7925 after 488 steps (sync mode, target 0.77)``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ctr_data  # noqa: E402
import ctr_stream  # noqa: E402
from ctr_report import JobCurves, Throughput, progress, result_line  # noqa: E402

from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv, TableOptions  # noqa: E402

TARGET_AUC = 0.77
DIM = 16
# Capacity hint for the distributed tables; ids are any int64 and may exceed it.
CAPACITY = 1 << 22
log = logging.getLogger("train_ctr")


class WideDeep(nn.Module):
    """logit = wide(ids).sum + MLP([deep(ids) flattened, dense features])."""

    def __init__(
        self, capacity: int = CAPACITY, dim: int = DIM, hidden=(400, 400, 400), table_device: str = "cpu"
    ):
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


TABLES = {
    "wide": TableOptions(optimizer="adagrad", optimizer_kwargs={"lr": 0.05}, init="zeros"),
    "deep": TableOptions(
        optimizer="adagrad", optimizer_kwargs={"lr": 0.05}, init="normal", init_kwargs={"std": 0.01}
    ),
}


def build_program(lr: float = 1e-3) -> Program:
    """Dense MLP with Adam; both tables distributed, Adagrad (also for ``python -m transpiler show``).

    The tables are built on the meta device: their rows live on the pservers,
    so no role needs the ``capacity x dim`` weight ``nn.Embedding`` would allocate.
    """
    return Program(build_model(table_device="meta"), "adam", lr=lr, distributed_tables=TABLES)


def train_stream(args, shard: int, shards: int) -> ctr_stream.CtrStream:
    """Shard ``shard`` of ``shards`` of the training examples, in batches of ``--batch_size``.

    Every shard has the same number of batches per epoch (``even``), so in sync
    mode no trainer waits at a barrier for one that has run out of data.
    """
    if args.test_data:
        source = ctr_stream.CriteoFile(args.data, stop=args.limit)
    elif args.data:
        lines = len(ctr_stream.CriteoFile(args.data, stop=args.limit))
        source = ctr_stream.CriteoFile(args.data, stop=int(0.9 * lines))
    else:
        source = ctr_stream.Generated(args.train_examples, seed=args.seed, stream=0)
    return ctr_stream.CtrStream(source, args.batch_size, shard, shards, even=True)


def test_stream(args, batch_size: int = 8192) -> ctr_stream.CtrStream:
    """Every test example, in batches: ``--test_data``, the last 10% of ``--data``, or generated ones."""
    if args.test_data:
        source = ctr_stream.CriteoFile(args.test_data)
    elif args.data:
        lines = len(ctr_stream.CriteoFile(args.data, stop=args.limit))
        source = ctr_stream.CriteoFile(args.data, start=int(0.9 * lines), stop=lines)
    else:  # another sample of the same planted model
        source = ctr_stream.Generated(args.test_examples, seed=args.seed, stream=1)
    return ctr_stream.CtrStream(source, batch_size, even=False)


def evaluate(model: nn.Module, test: ctr_stream.CtrStream, capacity: int = 0) -> float:
    """Test AUC of ``model`` (scikit-learn's ``roc_auc_score``); ids are taken modulo ``capacity`` if
    given."""
    # Imported here: pservers, the other trainers and the DataLoader workers' forkserver never need it
    # (1.6 s of each one's start).
    from sklearn.metrics import roc_auc_score

    model.eval()
    scores, labels = [], []
    device = next(model.parameters()).device
    with torch.no_grad():
        for dense, ids, label in test:
            ids = ids.remainder(capacity) if capacity else ids
            scores.append(model(dense.to(device), ids).cpu())
            labels.append(label)
    model.train()
    return float(roc_auc_score(torch.cat(labels).numpy(), torch.cat(scores).numpy()))


def train_local(args) -> tuple:
    """Plain single-process PyTorch: nn.Embedding(sparse=True) with Adagrad, Adam on the MLP.

    Returns (test AUC, steps)."""
    train = train_stream(args, 0, 1)
    loader = ctr_stream.loader(train, args.workers)
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
    total = steps_to_train(args, len(train))
    with progress(total, args.progress, args.batch_size) as bar:
        for _ in range(args.epochs):
            if speed.steps >= total:
                break
            for dense_x, ids, y in loader:
                if speed.steps >= total:
                    break
                for o in opts:
                    o.zero_grad()
                loss = loss_fn(model(dense_x, ids.remainder(capacity)), y)
                loss.backward()
                for o in opts:
                    o.step()
                speed.step(len(y))
                bar.update(len(y))
    ctr_stream.stop_workers(loader)
    speed.report()
    return evaluate(model, test_stream(args), capacity), speed.steps


def steps_to_train(args, batches_per_epoch: int) -> int:
    """Steps of each trainer: every batch of every epoch, or ``--steps`` if fewer."""
    every = args.epochs * batches_per_epoch
    return min(args.steps, every) if args.steps else every


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--async", dest="sync_mode", action="store_false", help="asynchronous updates")
    p.add_argument("--data", help="Criteo-format TSV file (default: generated data)")
    p.add_argument(
        "--test_data", help="with --data: the test set's TSV file (default: the last 10%% of --data)"
    )
    p.add_argument("--limit", type=int, help="with --data: read at most this many lines")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="DataLoader processes reading each trainer's shard (0: the trainer's read-ahead thread)",
    )
    p.add_argument("--train_examples", type=int, default=1_000_000, help="generated, all trainers together")
    p.add_argument("--test_examples", type=int, default=100_000)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps (0: all epochs)")
    p.add_argument("--batch_size", type=int, default=1024, help="per trainer")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam's lr for the MLP")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=10, help="steps before the throughput clock starts")
    p.add_argument(
        "--threads", type=int, default=0, help="torch threads (0: 1 in a job, torch's default locally)"
    )
    p.add_argument("--no_progress", dest="progress", action="store_false")
    p.add_argument(
        "--grad_wire_dtype",
        choices=["bfloat16", "float16"],
        help="push gradients (table rows, dense blocks) in this dtype: half the bytes",
    )
    p.add_argument(
        "--metrics_every",
        type=int,
        default=100,
        help="every this many steps, the job's training AUC and mean loss over them, reduced over every "
        "trainer (TensorBoard: job/train_auc, job/loss_mean); 0: off",
    )
    p.add_argument("--target_auc", type=float, default=TARGET_AUC, help="exit 1 below this test AUC")
    p.add_argument("--save", default="ctr_dense.pt", help="trainer 0 saves the dense state_dict here")
    p.add_argument("--tables_dir", default="ctr_tables", help="pservers save the table shards here")
    p.add_argument("--export_dir", default="ctr_export", help="trainer 0 exports ids/rows files here")
    p.add_argument(
        "--no_save", dest="save_model", action="store_false", help="skip saving and exporting (benchmarks)"
    )
    p.add_argument(
        "--local_capacity",
        type=int,
        default=1 << 21,
        help="local run: rows of the dense nn.Embedding (ids taken modulo this)",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.metrics_every < 0:
        raise SystemExit(f"--metrics_every must be >= 0, got {args.metrics_every}")
    # PS_LOG_LEVEL: what ps-launch --log_level passes to every role.
    logging.basicConfig(
        level=os.environ.get("PS_LOG_LEVEL", "INFO").upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    env = RoleEnv.from_env()
    if args.threads:
        torch.set_num_threads(args.threads)
    elif env is not None:
        torch.set_num_threads(1)  # several roles share this machine's cores
    if env is None:
        score, steps = train_local(args)
        print(result_line("local run", score, steps, "local", args.target_auc), flush=True)
        return 0 if score >= args.target_auc else 1

    # Async: overlap each step's push with the next forward/backward (Adam and Adagrad take
    # the extra step of staleness well; the AUC matches sync mode).
    t = DistributeTranspiler(
        DistributeTranspilerConfig(async_pipeline=True, grad_wire_dtype=args.grad_wire_dtype)
    )
    t.transpile(
        env.trainer_id,
        program=build_program(args.lr),
        pservers=env.pserver_list,
        trainers=env.trainers,
        sync_mode=args.sync_mode,
    )
    if env.is_pserver:
        from pserver import ParameterServer

        ps_program = t.get_pserver_program(env.current_endpoint)
        ParameterServer(ps_program, t.get_startup_program(env.current_endpoint, ps_program)).serve()
        return 0

    from trainer import Trainer

    # Every process reads its own shard: a trainer node of L processes reads L of them.
    shard, shards = (
        env.trainer_id * env.local_world_size + env.local_rank,
        env.trainers * env.local_world_size,
    )
    train = train_stream(args, shard, shards)
    loader = ctr_stream.loader(train, args.workers)
    role = f"trainer {env.trainer_id}" + (f" local rank {env.local_rank}" if env.local_world_size > 1 else "")
    leader = env.trainer_id == 0 and env.local_rank == 0
    log.info(
        "%s: shard %d of %d, %d batches of %d per epoch", role, shard, shards, len(train), args.batch_size
    )
    loss_fn = nn.BCEWithLogitsLoss()
    speed = Throughput(args.warmup, role)
    total = steps_to_train(args, len(train))

    def steps_done(position) -> int:
        epoch, batch = position
        return epoch * len(train) + batch

    curves = JobCurves(args.metrics_every) if args.metrics_every > 0 else None
    with Trainer(t.get_trainer_program()) as tr:
        # A restarted trainer (or a job resumed from a checkpoint) goes on from its data position:
        # tr.batches skips the batches before it, and replays those since a checkpoint the job rolled back to.
        with progress(
            total, args.progress and leader, args.batch_size, min(steps_done(tr.position), total)
        ) as bar:
            # Each next batch's ids ride with this step's push (read and routed on the feed thread).
            for dense_x, ids, y in tr.batches(
                loader, args.epochs, prefetch=lambda b: {"wide": b[1], "deep": b[1]}
            ):
                if steps_done(tr.position) >= total:
                    break
                # Both tables in one round trip per pserver; after the first step their rows came with
                # the last step's answer already, and this asks nothing.
                tr.prefetch({"wide": ids, "deep": ids})
                # ids stay on the CPU (deduplicated and routed there); the rest goes to the trainer's device
                logits = tr.model(dense_x.to(tr.device), ids)
                loss = loss_fn(logits, y.to(tr.device))
                loss.backward()
                tr.step()
                speed.step(len(y))
                bar.update(len(y))
                if (
                    speed.steps % 10 == 0
                ):  # TensorBoard (--tensorboard_dir): nothing is written when it is off
                    tr.log_scalars({"loss": loss.item()})
                if curves is not None:
                    curves.add(logits, y, loss)
                    curves.maybe_reduce(tr, role, leader)
                if speed.steps % 50 == 0:
                    bar.set_postfix(loss=f"{loss.item():.4f}")
        ctr_stream.stop_workers(loader)  # before the evaluation, not whenever the loader is freed
        speed.report()
        if env.trainer_id != 0:
            return 0
        steps = steps_done(tr.position)
        mode = "sync" if args.sync_mode else "async"
        score = evaluate(tr.model, test_stream(args))
        tr.log_scalars({"test_auc": score})
        if not args.save_model:
            print(result_line(role, score, steps, mode, args.target_auc), flush=True)
            return 0 if score >= args.target_auc else 1
        # Every local rank of node 0 calls these (on a node they are collectives); its leader writes.
        state = tr.state_dict()
        paths = tr.save_tables(os.path.abspath(args.tables_dir))
        if leader:
            torch.save(state, args.save)
            log.info("%s: dense state_dict saved to %s, table shards to %s", role, args.save, paths)
    if leader:
        from pserver.tables.plain_files import export_tables

        for table, meta in export_tables(args.tables_dir, args.export_dir).items():
            log.info("exported table %s: %d rows to %s", table, meta["rows"], args.export_dir)
    print(result_line(role, score, steps, mode, args.target_auc), flush=True)
    return 0 if score >= args.target_auc else 1


if __name__ == "__main__":
    sys.exit(main())
