"""Operators see each table's lifecycle: ps-stat and /metrics report rows, admitted, refused and
evicted per table and pserver, equal to what the shards counted."""

import json

import pytest
from torch import nn

from harness.cluster import LocalCluster
from pserver.ops import stat_cli
from tests.helpers.table_models import table_batches, table_program
from tests.pserver.test_metrics import scrape, value
from transpiler import DistributeTranspilerConfig


@pytest.mark.timeout(60)
def test_ps_stat_and_metrics_show_each_tables_lifecycle(capsys):
    rules = {"admit_count": 2, "evict_unseen_steps": 2}
    build = lambda: table_program("sgd", tables={"emb": {"lifecycle": rules}, "bag": None}, lr=0.3)  # noqa: E731
    data = table_batches(2, 6, 8, seed=1)
    with LocalCluster(build, 2, 2, config=DistributeTranspilerConfig(metrics_port=0)) as cluster:

        def body(tr, i):
            for step_batches in data:
                ids, bag, y = step_batches[i]
                nn.functional.cross_entropy(tr.model(ids, bag), y).backward()
                tr.step()

        cluster.run_trainers(body)
        counts = [s.engine.tables.shards["emb"].life.counts for s in cluster.servers]
        held = [len(s.engine.tables.shards["emb"]) for s in cluster.servers]
        assert all(c.refused and c.evicted and c.admitted for c in counts)

        assert stat_cli.main([",".join(cluster.endpoints), "--json", "--interval", "0"]) == 0
        replies = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        for reply, c, n in zip(replies, counts, held):
            emb = {t["table"]: t for t in reply["tables"]}["emb"]
            assert (emb["rows"], emb["admitted"], emb["refused"], emb["evicted"]) == (
                n,
                c.admitted,
                c.refused,
                c.evicted,
            )
            assert emb["admitted"] - emb["evicted"] == emb["rows"]
            assert {t["table"]: t for t in reply["tables"]}["bag"]["refused"] == 0

        assert stat_cli.main([",".join(cluster.endpoints), "--interval", "0"]) == 0
        text = capsys.readouterr().out
        assert "TABLE  ENDPOINT" in text
        line = next(ln for ln in text.splitlines() if ln.startswith("emb") and cluster.endpoints[0] in ln)
        assert f"{counts[0].evicted:,}" in line.split() and f"{counts[0].refused:,}" in line.split()

        for server, c, n in zip(cluster.servers, counts, held):
            m = scrape(server.metrics_port)
            assert value(m, "ps_table_shard_rows", table="emb", tier="ram") == n
            assert value(m, "ps_table_shard_rows", table="emb", tier="disk") == 0
            for event in ("admitted", "refused", "evicted"):
                assert value(m, "ps_table_lifecycle_rows_total", table="emb", event=event) == getattr(
                    c, event
                )
