"""bench_push's replay serves real pushes through the pserver's data calls: every push counted, the steps
applied, each answer the pserver's blocks and rows; on a small job S of its own (no peers' folder)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from benchmarks import bench_push


def small_jobs():
    """What the replay reads of the peers' ``jobs`` module, small: 4 slots of dim 4, 6 dense features."""

    def ctr_batch(index, batch=512):
        rng = np.random.default_rng(index)
        return (rng.integers(0, 3000, size=(batch, 4)) + (np.arange(4) << 40)).astype(np.int64), None, None

    return types.SimpleNamespace(
        S_EMB_DIM=4, S_HIDDEN=(8, 4), S_SLOTS=4, S_DENSE=6, S_LR=0.05, ctr_batch=ctr_batch
    )


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_the_replay_counts_every_push_and_answers_what_the_pserver_holds(mode):
    replay = bench_push.Replay(small_jobs(), sync=mode == "sync")
    try:
        timed = replay.run(4)
        engine = replay.engine
        steps = bench_push.WARMUP + 4
        assert engine.step == (steps if mode == "sync" else steps * bench_push.TRAINERS)
        assert replay.data.counters.pushes == steps * bench_push.TRAINERS
        assert len(timed) == 4 * bench_push.TRAINERS and all(v >= 0 for p in timed for v in p.values())
        # The last answer: the blocks as the store holds them, then the rows of the last next ids.
        start = replay.payloads.lane(1, 0).layout.nbytes
        flat = replay.out[:start].view(np.float32)
        store = engine.store.flat.numpy()
        assert np.array_equal(flat[: store.size], store)
        ids = replay._ids(steps * bench_push.TRAINERS + 1)
        rows = replay.out[start : start + ids.size * 16].view(np.float32).reshape(-1, 4)
        ((_, looked_up),) = engine.lookup({bench_push.TABLE: ids})[1]
        assert torch.equal(torch.from_numpy(rows.copy()), looked_up)
    finally:
        replay.close()
    figures = bench_push.summary(timed)
    assert list(figures) == [*bench_push.PHASES, "push"] and all(len(v) == 3 for v in figures.values())


def test_bad_arguments_are_refused():
    for argv in (["--modes", "geo"], ["--modes", ""], ["--steps", "2"]):
        with pytest.raises(SystemExit) as e:
            bench_push.main(argv)
        assert e.value.code == 2
