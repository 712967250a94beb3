"""Admission and eviction train exactly like a single-process reference of the same rules.

2 trainers, sync, 2 and 3 pservers: after every step of a run long enough for ids to be
refused, admitted, evicted and admitted again, the rows the trainers pull for the whole
vocabulary (initial rows for ids holding none), the dense parameters and the set of stored
ids equal :func:`tests.helpers.lifecycle_reference.single_process_lifecycle`, which applies
docs/tables.md's rules by hand with exact counts.
"""

import numpy as np
import pytest
import torch

from harness.cluster import LocalCluster
from tests.helpers.lifecycle_reference import single_process_lifecycle
from tests.helpers.table_models import VOCAB, table_batches, table_program
from tests.tables.test_sync import train

STEPS = 14
PER_TRAINER = 6
# float32, safe on any CPU as tests.tables.test_sync.assert_matches's: 0.07 of it used at most, 0.05
# with ATen's and MKL's non-vectorized kernels.
TOL = dict(rtol=1e-5, atol=1e-6)

RULES = {
    "count+steps": {"admit_count": 2, "evict_unseen_steps": 3},
    "count+decay+steps/2": {
        "admit_count": 3,
        "admit_decay_steps": 4,
        "evict_unseen_steps": 4,
        "sweep_every_steps": 2,
    },
    "probability+score": {"admit_probability": 0.6, "evict_score_below": 0.5, "score_decay": 0.8},
}
OPTIMIZERS = {
    "sgd": dict(lr=0.5),
    "adagrad": dict(lr=0.3, initial_accumulator_value=0.1),
    "adam": dict(lr=0.05),
}


def build(rules, optimizer):
    tables = {"emb": {"lifecycle": rules}, "bag": {"lifecycle": rules}}
    return lambda: table_program(optimizer, tables=tables, **OPTIMIZERS[optimizer])


def stored_ids(cluster, table):
    ids = [s.engine.tables.shards[table].stored_ids() for s in cluster.servers]
    return sorted(np.concatenate(ids).tolist())


# Each rule set with each optimizer was checked once (18 cases); the suite keeps these four.
CASES = [
    ("count+steps", "sgd"),
    ("count+steps", "adam"),
    ("count+decay+steps/2", "adagrad"),
    ("probability+score", "sgd"),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("n_pservers", [2, 3])
@pytest.mark.parametrize("rules,optimizer", CASES)
def test_lifecycle_sync_matches_single_process(n_pservers, rules, optimizer):
    data = table_batches(2, PER_TRAINER, STEPS, seed=7)
    make = build(RULES[rules], optimizer)
    with LocalCluster(make, n_pservers, 2) as cluster:
        results = train(cluster, data)
        stored = {t: stored_ids(cluster, t) for t in ("emb", "bag")}
        counts = [s.engine.tables.shards["emb"].life.counts for s in cluster.servers]
    state, rows, ref_stored = single_process_lifecycle(make(), data)
    for i in (0, 1):
        got_state, got_rows = results[i]
        for name in state:
            torch.testing.assert_close(got_state[name], state[name], **TOL, msg=lambda m: f"{name}: {m}")
        for name in rows:
            torch.testing.assert_close(got_rows[name], rows[name], **TOL, msg=lambda m: f"table {name}: {m}")
    assert stored == ref_stored
    # The rules really acted: ids were refused, admitted and evicted, and some rows remain.
    assert sum(c.refused for c in counts) > 0 and sum(c.evicted for c in counts) > 0
    assert 0 < len(stored["emb"]) < len(VOCAB)
