"""Tables saved by the pservers resume on any number of pservers, and export to plain files."""

import json

import numpy as np
import pytest
import torch
from torch import nn

from harness.cluster import LocalCluster
from pserver.tables.cli import main as export_main
from pserver.tables.plain_files import export_tables
from transpiler import Program

VOCAB = np.unique(np.random.default_rng(21).integers(-(2**40), 2**40, size=60, dtype=np.int64))


class Scorer(nn.Module):
    """Tables only: a score per example from two tables of different dims."""

    def __init__(self):
        super().__init__()
        self.user = nn.Embedding(100, 4, sparse=True)
        self.item = nn.EmbeddingBag(100, 3, mode="sum", sparse=True)

    def forward(self, users, items):
        return self.user(users).sum(1) + self.item(items).sum(1)


def program():
    return Program(Scorer(), "adam", lr=0.05, distributed_tables=["user", "item"])


def batches(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [
        (
            torch.from_numpy(VOCAB[rng.integers(0, 40, size=8)]),
            torch.from_numpy(VOCAB[rng.integers(20, 60, size=(8, 3))]),
            torch.from_numpy(rng.normal(size=8).astype(np.float32)),
        )
        for _ in range(steps)
    ]


def train(tr, data):
    for users, items, y in data:
        nn.functional.mse_loss(tr.model(users, items), y).backward()
        tr.step()


def rows(tr):
    return {t: tr.pull_rows(t, torch.from_numpy(VOCAB)) for t in ("user", "item")}


@pytest.mark.timeout(60)
def test_saved_tables_resume_on_another_number_of_pservers(tmp_path):
    data = batches(6)
    saved = str(tmp_path / "tables")
    with LocalCluster(program, 3, 1) as cluster:
        with cluster.trainer(0) as tr:
            train(tr, data[:3])
            paths = tr.save_tables(saved)
            at_save = rows(tr)
            train(tr, data[3:])
            uninterrupted = rows(tr)
    assert sorted(p.split("tables/")[1] for p in paths) == [
        f"{t}/shard-{k}-of-3" for t in ("item", "user") for k in range(3)
    ]

    # Two pservers load the three shards of each table: same rows, and the optimizer state and
    # step count follow, so the next steps continue exactly as the uninterrupted run did.
    with LocalCluster(program, 2, 1, tables_from=saved) as cluster:
        assert sum(s.engine.tables.rows for s in cluster.servers) == sum(
            len(np.load(f"{p}/ids.npy")) for p in paths
        )
        assert {s.engine.tables.shards["user"].step for s in cluster.servers} == {3}
        with cluster.trainer(0) as tr:
            for t, r in rows(tr).items():
                torch.testing.assert_close(r, at_save[t], rtol=0, atol=0)
            train(tr, data[3:])
            for t, r in rows(tr).items():
                torch.testing.assert_close(r, uninterrupted[t], rtol=1e-6, atol=1e-7)

    # One ids/rows file set per table, readable with numpy alone.
    info = export_tables(saved, str(tmp_path / "export"))
    assert sorted(info) == ["item", "user"]
    for t in ("user", "item"):
        ids = np.load(tmp_path / "export" / f"{t}.ids.npy")
        table_rows = np.load(tmp_path / "export" / f"{t}.rows.npy")
        by_id = dict(zip(VOCAB.tolist(), range(len(VOCAB))))
        expected = at_save[t].numpy()[[by_id[i] for i in ids.tolist()]]
        np.testing.assert_array_equal(table_rows, expected)
        assert json.loads((tmp_path / "export" / f"{t}.json").read_text())["rows"] == len(ids)
    assert export_main([saved, str(tmp_path / "again")]) == 0
    assert export_main([str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


@pytest.mark.timeout(30)
def test_pserver_refuses_tables_saved_for_another_table_layout(tmp_path):
    with LocalCluster(program, 1, 1) as cluster:
        with cluster.trainer(0) as tr:
            train(tr, batches(1))
            tr.save_tables(str(tmp_path / "t"))

    def other():
        return Program(Scorer().requires_grad_(True), "sgd", lr=0.1, distributed_tables=["user", "item"])

    with pytest.raises(ValueError, match="optimizer"):
        with LocalCluster(other, 1, 1, tables_from=str(tmp_path / "t")):
            pass
    with pytest.raises(ValueError, match="no saved shards"):
        with LocalCluster(program, 1, 1, tables_from=str(tmp_path / "missing")):
            pass
