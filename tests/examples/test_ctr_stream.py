"""Tests of examples/ctr_stream.py: each trainer streams only its shard, in a fixed batch order,
through a DataLoader over an IterableDataset, with or without workers; a restarted trainer resumes
at its batch through ``Trainer.batches``."""

import sys
import time

import numpy as np
import pytest
import torch

from tests.helpers import paths

sys.path.insert(0, str(paths.EXAMPLES))
import ctr_data  # noqa: E402
import ctr_stream  # noqa: E402
import train_ctr  # noqa: E402
from ctr_stream import CriteoFile, CtrStream, Generated, assign, batches_per_epoch, shard_sizes  # noqa: E402

from harness.cluster import LocalCluster  # noqa: E402
from trainer.errors import PserverError  # noqa: E402
from transpiler import DistributeTranspilerConfig, Program  # noqa: E402

LINES = 2500


@pytest.fixture(scope="module")
def tsv(tmp_path_factory):
    """(path, every line featurized) of a Criteo file with CRLF line ends and no final newline."""
    raw = ctr_data.generate_raw(LINES, seed=5, vocab_size=3000)
    path = tmp_path_factory.mktemp("ctr") / "train.tsv"
    ctr_data.write_criteo_tsv(path, *raw)
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n")[:-2])
    return path, ctr_data.featurize(*raw)


def concat(batches):
    return ctr_data.CtrData(*(torch.cat([b[i] for b in batches]).numpy() for i in range(3)))


def assert_same(a, b):
    for field in ("dense", "ids", "label"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))


def assert_same_batches(got, expected):
    assert [len(b[2]) for b in got] == [len(b[2]) for b in expected]
    for g, e in zip(got, expected):
        for x, y in zip(g, e):
            assert torch.equal(x, y)


# ---------------------------------------------------------------- the sharding rule (pure)


@pytest.mark.parametrize(
    "records, shards, unit, sizes",
    [
        (10, 1, 1, [10]),
        (10, 3, 1, [4, 3, 3]),
        (2, 3, 1, [1, 1, 0]),
        (0, 2, 1, [0, 0]),
        (10, 2, 4, [6, 4]),  # units [0-3] [4-7] [8-9]: shard 0 has units 0 and 2
        (12, 2, 4, [8, 4]),
        (5000, 3, 1024, [2048, 1928, 1024]),  # unit 4 (904 records) to shard 1
    ],
)
def test_shard_sizes(records, shards, unit, sizes):
    assert shard_sizes(records, shards, unit).tolist() == sizes


@pytest.mark.parametrize("records, shards, unit, batch", [(10, 3, 1, 2), (5000, 3, 1024, 300), (77, 2, 4, 5)])
def test_assign_matches_dealing_units_round_robin_then_cutting_batches(records, shards, unit, batch):
    shard, number = assign(np.arange(records), shards, unit, batch)
    for s in range(shards):
        mine = [i for i in range(records) if (i // unit) % shards == s]  # the rule, spelled out
        assert np.flatnonzero(shard == s).tolist() == mine
        assert number[mine].tolist() == [rank // batch for rank in range(len(mine))]


@pytest.mark.parametrize(
    "records, shards, unit, batch, even, expected",
    [
        (10, 3, 1, 2, False, [2, 2, 2]),
        (10, 3, 1, 2, True, [1, 1, 1]),
        (5000, 3, 1024, 300, False, [7, 7, 4]),
        (5000, 3, 1024, 300, True, [3, 3, 3]),
        (5, 2, 1, 10, True, [0, 0]),
    ],
)
def test_batches_per_epoch(records, shards, unit, batch, even, expected):
    assert [batches_per_epoch(records, shards, unit, batch, s, even) for s in range(shards)] == expected


def test_bad_arguments_are_refused(tsv):
    with pytest.raises(ValueError, match="shards >= 1"):
        shard_sizes(10, 0)
    with pytest.raises(ValueError, match="0 <= shard < shards"):
        CtrStream(Generated(10), 2, shard=2, shards=2)
    with pytest.raises(ValueError, match="batch_size >= 1"):
        CtrStream(Generated(10), 0)
    with pytest.raises(ValueError, match="bad line range"):
        CriteoFile(tsv[0], start=5, stop=4)


# ---------------------------------------------------------------- sources and streams


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_file_shards_hold_every_line_once_in_file_order(tsv, shards):
    path, everything = tsv
    source = CriteoFile(path)
    assert len(source) == LINES
    parts = []
    for shard in range(shards):
        stream = CtrStream(source, 128, shard, shards, even=False)
        batches = list(stream)
        assert len(batches) == len(stream) and all(len(b[2]) == 128 for b in batches[:-1])
        part = concat(batches)
        assert_same(part, everything.subset(slice(shard, None, shards)))  # lines shard, shard + n, ...
        parts.append(part)
    assert sum(len(p) for p in parts) == LINES


def test_even_streams_give_every_trainer_the_same_full_batches(tsv):
    source = CriteoFile(tsv[0])
    streams = [CtrStream(source, 128, shard, 3) for shard in range(3)]
    assert [len(s) for s in streams] == [LINES // 3 // 128] * 3
    for shard, stream in enumerate(streams):
        batches = list(stream)
        assert len(batches) == len(stream) and {len(b[2]) for b in batches} == {128}
        assert_same(concat(batches), tsv[1].subset(slice(shard, None, 3)).subset(slice(0, len(stream) * 128)))


def test_file_line_range_and_the_line_numbers_of_errors(tmp_path, tsv):
    path, everything = tsv
    assert_same(
        concat(list(CtrStream(CriteoFile(path, start=1000, stop=1700), 64, even=False))),
        everything.subset(slice(1000, 1700)),
    )
    assert_same(
        concat(list(CtrStream(CriteoFile(path, start=2400), 64, even=False))),
        everything.subset(slice(2400, None)),
    )
    assert len(CriteoFile(path, start=LINES + 5)) == 0
    lines = path.read_bytes().split(b"\r\n")
    lines[1201] = b"x" + lines[1201]  # line 1202 of the file: record 201 of the range below
    bad = tmp_path / "bad.tsv"
    bad.write_bytes(b"\n".join(lines) + b"\n")
    source = CriteoFile(bad, start=1000)
    list(CtrStream(source, 64, shard=0, shards=2, even=False))  # the other shard's line is never parsed
    with pytest.raises(ValueError, match="bad.tsv: line 1202: field 1: label must be 0 or 1"):
        list(CtrStream(source, 64, shard=1, shards=2, even=False))


def test_generated_records_do_not_depend_on_the_sharding():
    source = Generated(5000, seed=1, vocab_size=2000)
    whole = concat(list(CtrStream(source, 5000, even=False)))
    assert len(whole) == 5000
    assert_same(whole.subset(slice(0, 1024)), ctr_data.generate(1024, 1, 2000, sample_seed=(0, 0)))
    shard, _ = assign(np.arange(5000), 3, ctr_stream.UNIT, 300)
    for s in range(3):
        got = concat(list(CtrStream(source, 300, s, 3, even=False)))
        assert_same(got, whole.subset(shard == s))
    other = concat(list(CtrStream(Generated(5000, seed=1, stream=1, vocab_size=2000), 5000, even=False)))
    assert not np.array_equal(other.ids, whole.ids)


@pytest.mark.processes  # DataLoader worker processes
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")  # 2 cores here
def test_dataloader_workers_split_the_batches_and_keep_their_order(tsv):
    """Batch k is read by worker k % 3 (get_worker_info); the DataLoader takes them in turn, so
    the batches are those of a single reader, in the same order, every epoch (the workers persist)."""
    source = CriteoFile(tsv[0])
    stream = CtrStream(source, 100, shard=1, shards=2, even=False)  # 1250 lines: 13 batches, the last short
    expected = list(stream)
    assert len(expected) == 13 and len(expected[-1][2]) == 50
    loader = ctr_stream.loader(stream, workers=3)
    for _ in range(2):
        assert_same_batches(list(loader), expected)
    workers = list(loader._iterator._workers)
    assert len(workers) == 3 and all(w.is_alive() for w in workers)
    # stop_workers: the processes are gone when it returns, and the loader starts new ones when read again.
    ctr_stream.stop_workers(loader)
    assert not any(w.is_alive() for w in workers)
    assert_same_batches(list(loader), expected)
    ctr_stream.stop_workers(loader)
    ctr_stream.stop_workers(loader)  # none running: nothing to do


# ---------------------------------------------------------------- resuming through Trainer.batches


def small_program() -> Program:
    torch.manual_seed(0)
    return Program(
        train_ctr.WideDeep(1000, hidden=(8,), table_device="meta"),
        "adam",
        lr=1e-3,
        distributed_tables=train_ctr.TABLES,
    )


def train(tr, loader, epochs, got, stop_after=None):
    """Train on tr.batches(loader), recording each batch's labels; return after ``stop_after`` batches."""
    for dense, ids, y in tr.batches(loader, epochs, prefetch=lambda b: {"wide": b[1], "deep": b[1]}):
        got.append(y)
        torch.nn.functional.binary_cross_entropy_with_logits(tr.model(dense, ids), y).backward()
        tr.step()
        if stop_after is not None and len(got) == stop_after:
            return


def take_over(cluster, trainer_id: int, timeout: float = 30.0):
    """A new trainer process for ``trainer_id``, once the pservers let it replace the silent one."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cluster.trainer(trainer_id)
        except PserverError as e:
            if "already running" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.processes  # DataLoader worker processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop_after", [5, 22])  # mid epoch 0; epoch 1, batch 3
def test_a_restarted_trainer_resumes_at_its_batch(stop_after):
    """A trainer dies after ``stop_after`` steps; the one started in its place is told its data
    position by the pservers and trains exactly the batches an uninterrupted run had left."""
    stream = CtrStream(Generated(5000, seed=2, vocab_size=2000), 256)
    epoch = [b[2] for b in stream]
    assert len(epoch) == 19
    config = DistributeTranspilerConfig(heartbeat_interval=0.1, heartbeat_timeout=1.0)
    with LocalCluster(small_program, 1, 1, config=config) as cluster:
        got = []
        first = cluster.trainer(0)
        try:
            train(first, ctr_stream.loader(stream, workers=2), 2, got, stop_after)
            first._heartbeat.stop()  # the process dies: silent from now on
            with take_over(cluster, 0) as second:
                assert second.position == divmod(stop_after, 19)
                train(second, ctr_stream.loader(stream, workers=2), 2, got)
                assert second.position == (2, 0) and second.step_count == 38
        finally:
            first.close()  # fenced by now: only releases its connections
    assert len(got) == 38
    for g, e in zip(got, epoch + epoch):
        assert torch.equal(g, e)
