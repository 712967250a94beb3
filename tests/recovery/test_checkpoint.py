"""Checkpoints: consistent parts on every pserver, crash-safe writes, re-sharding, export."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness.cluster import LocalCluster
from pserver.checkpoint import layout as checkpoint
from pserver.checkpoint.cli import main as checkpoint_main
from tests.helpers import checkpoint_models as cm
from tests.helpers.paths import SCRIPTS


def assert_same(a: dict, b: dict, atol: float = 0.0) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m: f"{k}: {m}")


@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
def test_checkpoint_of_3_pservers_resumes_on_2_as_the_same_model(tmp_path, optimizer):
    root = str(tmp_path / "ckpt")
    data = cm.batches(6)
    build = lambda: cm.program(optimizer)  # noqa: E731
    with LocalCluster(build, 3, 1, config=cm.config(root)) as cluster:
        with cluster.trainer(0) as tr:
            cm.train(tr, data[:3])
            parts = tr.checkpoint()
            at_checkpoint = cm.snapshot(tr)
            cm.train(tr, data[3:])
            uninterrupted = cm.snapshot(tr)
    assert [os.path.basename(p) for p in parts] == [f"pserver-{k}-of-3" for k in range(3)]
    assert len(set(map(os.path.dirname, parts))) == 1  # one step directory: one consistent model

    with LocalCluster(build, 2, 1, config=cm.config(root)) as cluster:
        assert [s.engine.step for s in cluster.servers] == [3, 3]
        with cluster.trainer(0) as tr:
            assert tr.step_count == 3
            assert_same(cm.snapshot(tr), at_checkpoint)
            # Optimizer state (Adam moments and step, momentum buffers) was re-sharded too.
            cm.train(tr, data[3:])
            assert_same(cm.snapshot(tr), uninterrupted, atol=1e-6)


@pytest.mark.timeout(60)
def test_checkpoints_every_k_steps_keep_the_newest_and_export_for_serving(tmp_path):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "export")
    with LocalCluster(cm.program, 2, 1, config=cm.config(root, checkpoint_every=2, checkpoint_keep=2)) as c:
        with c.trainer(0) as tr:
            cm.train(tr, cm.batches(7))
            final = cm.snapshot(tr)
            dense = {k: v for k, v in tr.state_dict().items() if not k.startswith("emb.")}
            last = tr.checkpoint()  # at step 7
        stats = [s.servicer.control.Stats(b"", None) for s in c.servers]
    assert [s.checkpoint_step for s in stats] == [7, 7]
    assert sorted(step for step, _ in checkpoint.list_parts(root)) == [6, 7]  # 2, 4 pruned
    assert all(os.path.dirname(p).endswith("step-000000000007") for p in last)

    assert checkpoint_main(["export", root, out]) == 0
    state = torch.load(os.path.join(out, "state_dict.pt"), weights_only=True)
    assert_same(state, dense)
    model = cm.Ranker()
    model.load_state_dict(state, strict=False)  # the table is exported apart
    ids = np.load(os.path.join(out, "tables", "emb.ids.npy"))
    rows = np.load(os.path.join(out, "tables", "emb.rows.npy"))
    by_id = dict(zip(ids.tolist(), rows))
    used = [i for i in cm.IDS.tolist() if i in by_id]
    assert len(used) > 10
    expected = final["emb@rows"][[cm.IDS.tolist().index(i) for i in used]]
    np.testing.assert_array_equal(np.stack([by_id[i] for i in used]), expected.numpy())
    assert checkpoint_main(["list", root]) == 0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("point", ["blocks", "tables", "manifest"])
@pytest.mark.processes
def test_crash_during_a_checkpoint_write_leaves_the_previous_one_loadable(tmp_path, point):
    root, out = str(tmp_path / "ckpt"), str(tmp_path / "at-step-2.pt")
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "crash_in_checkpoint.py"), root, out, point],
        capture_output=True,
        text=True,
        timeout=80,
    )
    assert proc.returncode == -9, proc.stdout + proc.stderr  # died by SIGKILL mid-write
    assert os.path.exists(checkpoint.step_directory(root, 3))  # the interrupted write left files
    assert checkpoint.find_saved(root, sync_mode=True).step == 2

    expected = torch.load(out, weights_only=True)
    with LocalCluster(cm.program, 2, 1, config=cm.config(root)) as cluster:
        with cluster.trainer(0) as tr:
            assert tr.step_count == 2
            assert_same(cm.snapshot(tr), expected)
            cm.train(tr, cm.batches(1, seed=9))
            tr.checkpoint()  # the same step again, over the interrupted files
    assert checkpoint.find_saved(root, sync_mode=True).step == 3
