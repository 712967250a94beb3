"""A model with distributed tables, its data, and its single-process torch reference.

Ids are arbitrary int64 (negative and far beyond ``num_embeddings``): the
distributed run looks them up directly, the reference maps each to its
position in the vocabulary and trains a plain ``nn.Embedding(sparse=True)``
whose rows start at the table's initial values for those ids.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from transpiler import Program
from transpiler.tables import initial_rows

DIM, BAG_DIM, SLOTS, BAG_LEN, CLASSES = 6, 4, 3, 5, 3
# Ids the data draws from: spread over the whole int64 range, negatives included.
VOCAB = np.unique(np.random.default_rng(11).integers(-(2**62), 2**62, size=40, dtype=np.int64))
BAG_VOCAB = np.unique(np.random.default_rng(12).integers(-1000, 10**12, size=25, dtype=np.int64))


def zipf_ids(n: int, seed: int) -> np.ndarray:
    """``n`` ids for the id kernels' tests: Zipf-like over the whole int64 range, so many repeats, negatives
    and the two extremes."""
    rng = np.random.default_rng(seed)
    pool = rng.integers(-(2**63), 2**63 - 1, size=max(n // 3, 1), dtype=np.int64, endpoint=True)
    pool[:2] = [np.iinfo(np.int64).min, np.iinfo(np.int64).max][: pool.size]
    return pool[np.minimum(rng.zipf(1.2, size=n) - 1, pool.size - 1)]


class TableModel(nn.Module):
    """An embedding of SLOTS ids per example, a mean-pooled bag, and a dense head."""

    def __init__(self, n_emb: int = 1000, n_bag: int = 1000, dtype=torch.float32):
        super().__init__()
        self.emb = nn.Embedding(n_emb, DIM, sparse=True, dtype=dtype)
        self.bag = nn.EmbeddingBag(n_bag, BAG_DIM, mode="mean", sparse=True, dtype=dtype)
        self.head = nn.Linear(SLOTS * DIM + BAG_DIM, CLASSES, dtype=dtype)

    def forward(self, ids, bag_ids):
        return self.head(torch.cat([self.emb(ids).flatten(1), self.bag(bag_ids)], dim=1))


def table_model(dtype=torch.float32) -> TableModel:
    torch.manual_seed(3)
    return TableModel(dtype=dtype)


def table_program(optimizer: str, dtype=torch.float32, tables=None, **kwargs) -> Program:
    tables = tables if tables is not None else ["emb", "bag"]
    return Program(table_model(dtype), optimizer, distributed_tables=tables, **kwargs)


def table_batches(n_trainers: int, per_trainer: int, steps: int, seed: int = 5):
    """``steps`` lists of per-trainer (ids, bag_ids, y); ids are raw int64 from the vocabularies."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(steps):
        n = n_trainers * per_trainer
        # A skewed draw: some ids repeat within and across trainers, some never appear.
        ids = torch.from_numpy(VOCAB[rng.zipf(1.5, size=(n, SLOTS)) % (len(VOCAB) - 5)])
        bag = torch.from_numpy(BAG_VOCAB[rng.integers(0, len(BAG_VOCAB), size=(n, BAG_LEN))])
        y = torch.from_numpy(rng.integers(0, CLASSES, size=n))
        out.append(
            [
                (
                    ids[i * per_trainer : (i + 1) * per_trainer],
                    bag[i * per_trainer : (i + 1) * per_trainer],
                    y[i * per_trainer : (i + 1) * per_trainer],
                )
                for i in range(n_trainers)
            ]
        )
    return out


def positions(vocab: np.ndarray, ids: torch.Tensor) -> torch.Tensor:
    """Each raw id's index in ``vocab``: its row in the reference's plain ``nn.Embedding``."""
    return torch.from_numpy(np.searchsorted(vocab, ids.numpy()))


VOCABS = {"emb": VOCAB, "bag": BAG_VOCAB}


def local_tables(prog: Program):
    """``prog``'s model with plain ``nn.Embedding(sparse=True)`` / ``nn.EmbeddingBag`` tables over the
    vocabularies, rows starting at the tables' initial values: (model, {table: spec}, {table: module},
    dense parameters)."""
    model = prog.model
    specs = {t.name: t for t in prog.tables}
    local = {
        "emb": nn.Embedding(len(VOCAB), DIM, sparse=True, dtype=model.emb.weight.dtype),
        "bag": nn.EmbeddingBag(
            len(BAG_VOCAB), BAG_DIM, mode="mean", sparse=True, dtype=model.bag.weight.dtype
        ),
    }
    with torch.no_grad():
        for name, module in local.items():
            if name in specs:
                module.weight.copy_(torch.from_numpy(initial_rows(specs[name], VOCABS[name])))
    model.emb, model.bag = local["emb"], local["bag"]
    dense = [p for n, p in model.named_parameters() if not n.startswith(tuple(specs))]
    return model, specs, local, dense


def single_process(prog: Program, data):
    """Plain torch on the concatenated batches: the dense optimizer on dense parameters, the
    tables' sparse optimizers (SGD, Adagrad, SparseAdam) on ``nn.Embedding(sparse=True)``
    weights initialised with the tables' initial rows. Returns (dense state, {table: rows})."""
    model, specs, local, dense = local_tables(prog)
    optimizers = [prog.optimizer.build(dense)]
    schedules = [prog.optimizer]
    for name, spec in specs.items():
        optimizers.append(spec.optimizer.build([local[name].weight]))
        schedules.append(spec.optimizer)
    scheds = [
        getattr(torch.optim.lr_scheduler, s.lr_scheduler)(o, **s.lr_scheduler_kwargs)
        for o, s in zip(optimizers, schedules)
        if s.lr_scheduler
    ]
    for step_batches in data:
        ids = torch.cat([b[0] for b in step_batches])
        bag = torch.cat([b[1] for b in step_batches])
        y = torch.cat([b[2] for b in step_batches])
        for o in optimizers:
            o.zero_grad()
        out = model(positions(VOCAB, ids), positions(BAG_VOCAB, bag))
        nn.functional.cross_entropy(out, y).backward()
        for o in optimizers:
            o.step()
        for s in scheds:
            s.step()
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(tuple(specs))}
    return state, {name: local[name].weight.detach().clone() for name in specs}


class Counting(nn.Module):
    """A model whose every push is counted: the bias's gradient is 1 a push, a table row's the number of
    times its id was looked up; with SGD at lr 1 in float64 the values are exact counts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)  # every role builds the same initial bias
        self.emb = nn.Embedding(1000, 2, sparse=True, dtype=torch.float64)
        self.count = nn.Linear(2, 1, dtype=torch.float64)

    def forward(self, ids):
        return self.count.bias.sum() + self.emb(ids).sum()


def counting_program() -> Program:
    """:class:`Counting` trained with SGD at lr 1, its table initialised to zeros."""
    return Program(Counting(), "sgd", lr=1.0, distributed_tables={"emb": {"init": "zeros"}})
