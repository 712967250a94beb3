"""A single-process reference of the table lifecycle rules, written from the definitions of docs/tables.md.

Plain torch trains the model on the concatenated batches (as
:func:`tests.helpers.table_models.single_process`), with ``nn.Embedding(sparse=True)``
tables, and applies the rules of docs/tables.md, "Table lifecycle" by hand,
with exact per-id counts instead of a sketch:

- a table's step is one optimizer step; an id holding no row is pending; its
  count goes up by one in each step it has a gradient while pending, and is
  halved (rounding down) at the end of every ``admit_decay_steps``-th step;
  it is admitted in the step the count reaches ``admit_count`` (and only if
  ``admissible``); gradients of pending ids are removed before the step;
- at the end of every ``sweep_every_steps``-th step, stored rows unseen for
  ``evict_unseen_steps`` steps, or with a decayed score below
  ``evict_score_below``, are evicted: the weight row goes back to its initial
  value and its optimizer state to its initial state.
"""

from __future__ import annotations

from typing import Dict, Set

import numpy as np
import torch
from torch import nn

from pserver.tables.lifecycle.admission import admissible
from transpiler import Program
from transpiler.tables import initial_rows

from .table_models import BAG_VOCAB, VOCAB, VOCABS, local_tables, positions


class ReferenceTable:
    """One table's lifecycle state in the reference: counts, stored ids, last update, score."""

    def __init__(self, spec, vocab: np.ndarray):
        self.spec, self.lc, self.vocab = spec, spec.lifecycle, vocab
        self.step = 0
        self.counts: Dict[int, int] = {}
        self.stored: Set[int] = set()
        self.last: Dict[int, int] = {}
        self.score: Dict[int, float] = {}

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """Keep-mask over ``ids`` (this step's gradient ids): stored or admitted now."""
        self.step += 1
        ok = admissible(ids, self.spec.seed, self.lc.admit_probability)
        keep = np.zeros(ids.size, dtype=bool)
        for j, i in enumerate(ids.tolist()):
            if i in self.stored:
                keep[j] = True
            elif ok[j]:
                self.counts[i] = self.counts.get(i, 0) + 1
                if self.counts[i] >= self.lc.admit_count:
                    self.stored.add(i)
                    self.score[i] = 0.0
                    keep[j] = True
        for i in ids[keep].tolist():
            last = self.last.get(i, self.step)
            self.score[i] = self.score[i] * self.lc.score_decay ** (self.step - last) + 1.0
            self.last[i] = self.step
        return keep

    def end_step(self) -> list:
        """Ids evicted at the end of this step; applies the count decay."""
        lc, t = self.lc, self.step
        gone = []
        if (lc.evict_unseen_steps or lc.evict_score_below) and t % lc.sweep_every_steps == 0:
            for i in sorted(self.stored):
                unseen = t - self.last[i]
                if lc.evict_unseen_steps and unseen >= lc.evict_unseen_steps:
                    gone.append(i)
                elif lc.evict_score_below and self.score[i] * lc.score_decay**unseen < lc.evict_score_below:
                    gone.append(i)
        for i in gone:
            self.stored.discard(i)
            del self.last[i], self.score[i]
        if lc.admit_decay_steps and t % lc.admit_decay_steps == 0:
            self.counts = {i: c // 2 for i, c in self.counts.items()}
        return gone


def _filter_grad(weight: torch.Tensor, vocab: np.ndarray, table: ReferenceTable) -> None:
    """Drop the rows of pending ids from ``weight.grad`` (sparse), in place of the gradient."""
    g = weight.grad.coalesce()
    pos = g.indices()[0].numpy()
    keep = torch.from_numpy(table.admit(vocab[pos]))
    weight.grad = torch.sparse_coo_tensor(
        g.indices()[:, keep], g.values()[keep], g.shape, check_invariants=False
    ).coalesce()


def _reset(
    weight: torch.Tensor,
    optimizer: torch.optim.Optimizer,
    vocab: np.ndarray,
    table: ReferenceTable,
    gone: list,
) -> None:
    """Evicted rows back to their initial value and initial optimizer state."""
    if not gone:
        return
    pos = torch.from_numpy(np.searchsorted(vocab, np.array(gone, dtype=np.int64)))
    with torch.no_grad():
        weight[pos] = torch.from_numpy(initial_rows(table.spec, np.array(gone, dtype=np.int64)))
        state = optimizer.state.get(weight, {})
        for key, value in state.items():
            if key == "sum":
                value[pos] = optimizer.defaults["initial_accumulator_value"]
            elif key in ("exp_avg", "exp_avg_sq"):
                value[pos] = 0


def single_process_lifecycle(prog: Program, data):
    """(dense state, {table: rows over its vocabulary}, {table: stored ids}) after training ``data``."""
    model, specs, local, dense = local_tables(prog)
    vocabs = VOCABS
    dense_opt = prog.optimizer.build(dense)
    table_opts = {name: spec.optimizer.build([local[name].weight]) for name, spec in specs.items()}
    tables = {name: ReferenceTable(spec, vocabs[name]) for name, spec in specs.items()}
    for step_batches in data:
        ids = torch.cat([b[0] for b in step_batches])
        bag = torch.cat([b[1] for b in step_batches])
        y = torch.cat([b[2] for b in step_batches])
        dense_opt.zero_grad()
        for o in table_opts.values():
            o.zero_grad()
        out = model(positions(VOCAB, ids), positions(BAG_VOCAB, bag))
        nn.functional.cross_entropy(out, y).backward()
        for name in specs:
            _filter_grad(local[name].weight, vocabs[name], tables[name])
        dense_opt.step()
        for name, o in table_opts.items():
            o.step()
            _reset(local[name].weight, o, vocabs[name], tables[name], tables[name].end_step())
    state = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith(tuple(specs))}
    rows = {name: local[name].weight.detach().clone() for name in specs}
    return state, rows, {name: sorted(t.stored) for name, t in tables.items()}
