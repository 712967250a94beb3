"""Serving exports: pservers write base and delta shards, a numpy-only reader follows the chain."""

import json
import logging
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from pserver.tables.serving import reader as serving_reader
from pserver.tables.serving.exports import (
    export_name,
    finish_export_shard,
    is_complete,
    prune_exports,
    write_export_shard,
)
from pserver.tables.serving.reader import ServingTables
from tests.helpers import paths

REPO = str(paths.REPO)
READER = os.path.join(REPO, "pserver", "tables", "serving", "reader.py")
SPECS = {"emb": (4, np.float32), "wide": (3, np.float64)}


class Job:
    """A job's tables as dicts of numpy rows, exported by ``n_shards`` simulated pservers (shard = id mod N).

    Like a pserver, it remembers which ids were touched since the last export:
    at the next delta a touched id that is live is written as a row, one that
    is not as a tombstone, so an id deleted and re-added in one window is a row.
    """

    def __init__(self, root, n_shards, seed=0):
        self.root, self.n = str(root), n_shards
        self.rng = np.random.default_rng(seed)
        self.live = {t: {} for t in SPECS}
        self.touched = {t: set() for t in SPECS}
        self.previous = None

    def put(self, table, ids):
        dim, dtype = SPECS[table]
        for i in np.asarray(ids, np.int64).tolist():
            self.live[table][i] = self.rng.standard_normal(dim).astype(dtype)
            self.touched[table].add(i)

    def delete(self, table, ids):
        for i in np.asarray(ids, np.int64).tolist():
            self.live[table].pop(i)
            self.touched[table].add(i)

    def random_live(self, table, k):
        return self.rng.choice(np.array(sorted(self.live[table]), np.int64), k, replace=False)

    def write(self, step, kind, shard):
        name = export_name(step, kind)
        for t, (dim, dtype) in SPECS.items():
            ids = self.live[t] if kind == "base" else self.touched[t]
            ids = np.array(sorted(i for i in ids if i % self.n == shard), np.int64)
            written = ids[[i in self.live[t] for i in ids.tolist()]] if ids.size else ids
            rows = np.array([self.live[t][i] for i in written.tolist()], dtype).reshape(-1, dim)
            write_export_shard(
                self.root,
                name,
                t,
                shard,
                self.n,
                written,
                rows,
                np.setdiff1d(ids, written),
                {"kind": kind, "step": step, "previous": None if kind == "base" else self.previous},
            )
        return name

    def export(self, step, kind, finish=None):
        """Every pserver writes its shards; those in ``finish`` (default all) then finish."""
        name = [self.write(step, kind, k) for k in range(self.n)][0]
        for k in range(self.n) if finish is None else finish:
            finish_export_shard(self.root, name, k, self.n)
        self.previous = name
        self.touched = {t: set() for t in SPECS}
        return name

    def check(self, reader, gone=()):
        assert reader.tables() == sorted(SPECS)
        for t in SPECS:
            want = np.array(sorted(self.live[t]), np.int64)
            np.testing.assert_array_equal(reader.ids(t), want)
            assert reader.rows(t) == want.size
            rows, found = reader.lookup(t, want)
            assert found.all() and rows.dtype == SPECS[t][1]
            expect = np.array([self.live[t][i] for i in want.tolist()]).reshape(-1, SPECS[t][0])
            np.testing.assert_array_equal(rows, expect)
            dead = np.array([i for i in gone if i not in self.live[t]], np.int64)
            rows, found = reader.lookup(t, dead)
            assert not found.any() and not rows.any()
        assert len(reader) == sum(len(v) for v in self.live.values())


def shard_files(root, name, table, shard, n):
    d = os.path.join(str(root), name, table, f"shard-{shard}-of-{n}")
    return {f: np.load(os.path.join(d, f"{f}.npy")) for f in ("ids", "rows", "tombstones")}


@pytest.mark.parametrize("n_shards", [2, 3])
def test_base_then_deltas_match_the_model(tmp_path, n_shards, monkeypatch):
    job, reader = Job(tmp_path, n_shards), ServingTables(str(tmp_path))
    assert reader.refresh() == [] and reader.loaded is None and reader.tables() == []
    for t in SPECS:
        job.put(t, np.unique(job.rng.integers(-1000, 1000, 300)))
    names = [job.export(100, "base")]
    assert reader.refresh() == names and reader.loaded == names[0]
    job.check(reader)

    gone = set()
    for t in SPECS:  # delta 1: updates, new ids, deletions
        deleted = job.random_live(t, 40)
        job.delete(t, deleted)
        gone.update(deleted.tolist())
        job.put(t, job.random_live(t, 50))
        job.put(t, np.arange(2000, 2030))
    names.append(job.export(200, "delta"))
    assert reader.refresh() == names[-1:]
    job.check(reader, gone)

    back = sorted(i for i in gone if i not in job.live["emb"])[:5]
    flip = int(job.random_live("emb", 1)[0])
    job.put("emb", back)  # delta 2: re-inserts ids deleted by delta 1
    job.delete("emb", [flip])
    job.put("emb", [flip])  # deleted and re-added in one window: a row, not a tombstone
    job.delete("wide", job.random_live("wide", 10))
    names.append(job.export(300, "delta"))
    files = shard_files(tmp_path, names[-1], "emb", flip % n_shards, n_shards)
    assert flip in files["ids"] and flip not in files["tombstones"]
    assert reader.refresh() == names[-1:]
    job.check(reader, gone)
    assert reader.lookup("emb", back)[1].all()

    opened = []
    real_open = serving_reader._open_export
    monkeypatch.setattr(serving_reader, "_open_export", lambda r, n: opened.append(n) or real_open(r, n))
    for t in SPECS:  # delta 3: an id added and deleted in one window, updates, deletions
        job.put(t, [5000])
        job.delete(t, [5000])
        deleted = job.random_live(t, 20)
        job.delete(t, deleted)
        gone.update(deleted.tolist() + [5000])
        job.put(t, job.random_live(t, 20))
    names.append(job.export(400, "delta"))
    assert reader.refresh() == names[-1:] and opened == names[-1:]  # the base is not read again
    job.check(reader, gone)
    assert reader.refresh() == [] and reader.loaded == names[-1]

    fresh = ServingTables(str(tmp_path))
    assert fresh.refresh() == names
    job.check(fresh, gone)

    new_base = job.export(500, "base")  # a newer base replaces the chain, then its deltas follow
    job.put("wide", [1, 2, 3])
    after = job.export(600, "delta")
    assert reader.refresh() == [new_base, after]
    job.check(reader, gone)


def test_partly_finished_export_waits_for_the_last_pserver(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    job, reader = Job(tmp_path, 2), ServingTables(str(tmp_path))
    job.put("emb", range(10))
    job.put("wide", range(10))
    base = job.export(1, "base")
    assert reader.refresh() == [base]
    before = {t: dict(v) for t, v in job.live.items()}
    job.put("emb", [1, 2, 20])
    delta = job.export(2, "delta", finish=[0])
    assert not is_complete(str(tmp_path), delta)
    assert reader.refresh() == [] and reader.loaded == base
    assert "not complete yet" in caplog.text and delta in caplog.text
    job.delete("emb", [20])
    later = job.export(3, "delta")  # complete, but follows the incomplete one: waits for it
    assert reader.refresh() == [] and reader.loaded == base
    assert f"waits for incomplete export {delta}" in caplog.text
    np.testing.assert_array_equal(reader.lookup("emb", [1])[0][0], before["emb"][1])
    assert not reader.lookup("emb", [20])[1].any()
    assert finish_export_shard(str(tmp_path), delta, 1, 2) is True
    assert reader.refresh() == [delta, later]
    job.check(reader, gone=[20])


def test_finishing_twice_and_together_creates_done_once(tmp_path):
    job = Job(tmp_path, 3)
    job.put("emb", range(6))
    name = job.export(1, "base", finish=[2, 0])
    assert not is_complete(str(tmp_path), name)
    assert finish_export_shard(str(tmp_path), name, 1, 3) is True
    assert finish_export_shard(str(tmp_path), name, 0, 3) is True  # DONE exists: FileExistsError ignored
    assert json.load(open(os.path.join(str(tmp_path), name, "DONE")))["completed_by"] == 1


def test_missing_shard_dir_is_refused_and_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    job, reader = Job(tmp_path, 2), ServingTables(str(tmp_path))
    job.put("emb", range(10))
    base = job.export(1, "base")
    assert reader.refresh() == [base]
    snapshot = {t: dict(v) for t, v in job.live.items()}
    job.put("emb", [3, 30])
    delta = job.export(2, "delta")
    shutil.rmtree(os.path.join(str(tmp_path), delta, "wide", "shard-1-of-2"))
    assert reader.refresh() == [] and reader.loaded == base
    assert "shard-1-of-2" in caplog.text and "missing" in caplog.text and "refused" in caplog.text
    job.live = snapshot
    job.check(reader)
    assert ServingTables(str(tmp_path)).refresh() == [base]


def test_shards_disagreeing_on_the_shard_count_are_refused(tmp_path, caplog):
    job = Job(tmp_path, 2)
    job.put("emb", range(4))
    base = job.export(1, "base")
    stray = os.path.join(str(tmp_path), base, "emb", "shard-0-of-3")
    shutil.copytree(os.path.join(str(tmp_path), base, "emb", "shard-0-of-2"), stray)
    reader = ServingTables(str(tmp_path))
    assert reader.refresh() == [] and reader.loaded is None
    assert "shard-0-of-3 in an export of 2 pservers" in caplog.text
    with pytest.raises(ValueError, match="shard count"):
        finish_export_shard(str(tmp_path), base, 0, 3)


def test_broken_chain_stops(tmp_path, caplog):
    job, reader = Job(tmp_path, 2), ServingTables(str(tmp_path))
    job.put("emb", range(8))
    base = job.export(10, "base")
    job.put("emb", [1])
    job.previous = export_name(5, "base")  # a base that was never written
    orphan = job.export(20, "delta")
    job.put("emb", [2])
    job.export(30, "delta")  # chains to the orphan
    assert reader.refresh() == [base] and reader.loaded == base
    assert f"stopping at delta {orphan}" in caplog.text
    assert reader.refresh() == []


def test_reader_needs_numpy_only(tmp_path):
    job = Job(tmp_path, 2)
    job.put("emb", [7, 8])
    job.export(3, "base")
    code = f"""
import sys, importlib.util, json
for m in ("torch", "grpc", "pserver", "transpiler", "trainer", "psproto"):
    sys.modules[m] = None  # any import of these now raises ImportError
spec = importlib.util.spec_from_file_location("serving_reader", {READER!r})
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
r = mod.ServingTables({str(tmp_path)!r})
applied = r.refresh()
rows, found = r.lookup("emb", [7, 9])
print(json.dumps({{"applied": applied, "row": rows[0].tolist(), "found": found.tolist()}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(tmp_path),
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": os.environ.get("PATH", "")},
    )
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["applied"] == [export_name(3, "base")] and got["found"] == [True, False]
    assert np.array(got["row"], np.float32).tolist() == job.live["emb"][7].tolist()


def test_cli_prints_rows(tmp_path):
    job = Job(tmp_path, 2)
    job.put("wide", [4, 5])
    job.export(1, "base")
    out = subprocess.run(
        [sys.executable, READER, str(tmp_path), "wide", "5", "6"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    lines = dict(line.split("\t") for line in out.stdout.splitlines() if not line.startswith("#"))
    np.testing.assert_array_equal(np.array(lines["5"].split(), float), job.live["wide"][5])
    assert lines["6"] == "not found"
    bad = subprocess.run(
        [sys.executable, READER, str(tmp_path), "nope", "1"], capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1 and "no table 'nope'" in bad.stderr


def test_prune_keeps_the_newest_bases_and_their_deltas(tmp_path):
    root = str(tmp_path)
    job = Job(tmp_path, 2)
    job.put("emb", range(5))
    plan = [
        (10, "base"),
        (20, "delta"),
        (30, "base"),
        (40, "delta"),
        (45, "delta", "half"),
        (50, "delta"),
        (60, "base"),
        (70, "delta"),
        (80, "delta", "half"),
    ]
    names = {}
    for step, kind, *half in plan:
        job.put("emb", [step])
        if half:  # a crashed (or, for the newest, still running) export: one pserver finished
            saved = job.previous
            names[step] = job.export(step, kind, finish=[0])
            job.previous = saved
        else:
            names[step] = job.export(step, kind)
    open(os.path.join(root, "notes.txt"), "w").close()
    assert prune_exports(root, keep_bases=2) == [names[10], names[20], names[45]]
    assert prune_exports(root, keep_bases=2) == []
    assert prune_exports(root, keep_bases=1) == [names[30], names[40], names[50]]
    assert sorted(os.listdir(root)) == sorted([names[60], names[70], names[80], "notes.txt"])
    reader = ServingTables(root)
    assert reader.refresh() == [names[60], names[70]]
    with pytest.raises(ValueError, match="keep_bases"):
        prune_exports(root, keep_bases=0)


def check_arrays_refused(root, match, ids=None, rows=None, tombstones=None, **meta):
    ids = np.arange(3, dtype=np.int64) if ids is None else ids
    rows = np.zeros((3, 2), np.float32) if rows is None else rows
    tombstones = np.empty(0, np.int64) if tombstones is None else tombstones
    meta = {"kind": "delta", "step": 2, "previous": export_name(1, "base"), **meta}
    name = export_name(meta["step"], meta["kind"]) if meta["kind"] in ("base", "delta") else "x"
    with pytest.raises(ValueError, match=match):
        write_export_shard(root, name, "emb", 0, 1, ids, rows, tombstones, meta)


def test_write_validates_its_inputs(tmp_path):
    root = str(tmp_path)
    check_arrays_refused(root, "1-D int64", ids=np.arange(3, dtype=np.int32))
    check_arrays_refused(root, "1-D int64", ids=np.zeros((3, 1), np.int64))
    check_arrays_refused(root, r"\(m, dim\)", rows=np.zeros((2, 2), np.float32))
    check_arrays_refused(root, "dtype", rows=np.zeros((3, 2), np.float16))
    check_arrays_refused(root, "both written and tombstoned", tombstones=np.array([2, 9], np.int64))
    check_arrays_refused(root, "duplicates", ids=np.array([1, 1, 2], np.int64))
    check_arrays_refused(root, "kind", kind="full")
    check_arrays_refused(root, "previous", previous=None)
    check_arrays_refused(root, "not older", previous=export_name(2, "base"))
    check_arrays_refused(
        root, "no tombstones", kind="base", previous=None, tombstones=np.array([7], np.int64)
    )
    with pytest.raises(ValueError, match="does not match"):
        write_export_shard(
            root,
            export_name(3, "base"),
            "emb",
            0,
            1,
            np.arange(1),
            np.zeros((1, 2)),
            None,
            {"kind": "base", "step": 4, "previous": None},
        )
    assert os.listdir(root) == []
    job = Job(tmp_path, 2)
    job.put("emb", [1])
    with pytest.raises(ValueError, match="wrote no table"):
        finish_export_shard(root, export_name(1, "base"), 0, 2)
    name = job.write(1, "base", 0)
    with pytest.raises(ValueError, match="has not written tables"):
        finish_export_shard(root, name, 1, 2)
    assert finish_export_shard(root, name, 0, 2) is False
    with pytest.raises(ValueError, match="already finished"):
        job.write(1, "base", 0)
    job.previous = export_name(0, "base")
    with pytest.raises(ValueError, match="at most one export"):
        job.write(1, "delta", 1)


WRITER = """
import sys
import numpy as np
from pserver.tables.serving.exports import export_name, finish_export_shard, write_export_shard
root = sys.argv[1]
rng = np.random.default_rng(0)
ids, rows = np.arange(1000, dtype=np.int64), rng.standard_normal((1000, 8)).astype(np.float32)
base = export_name(1, "base")
for k in range(2):
    mine = ids % 2 == k
    write_export_shard(root, base, "emb", k, 2, ids[mine], rows[mine], None,
                       {"kind": "base", "step": 1, "previous": None})
    finish_export_shard(root, base, k, 2)
meta = {"kind": "delta", "step": 2, "previous": base}
big = np.arange(200_000, dtype=np.int64)
for t in range(10 ** 6):  # never finishes: the parent kills it mid-export
    for k in range(2):
        write_export_shard(root, export_name(2, "delta"), "emb" if t == 0 else f"t{t}", k, 2,
                           big[big % 2 == k], np.ones((100_000, 16), np.float32), None, meta)
    if t == 0:
        print("started", flush=True)
"""


def test_sigkill_mid_export_leaves_the_previous_export_readable(tmp_path):
    root = str(tmp_path / "exports")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, root], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "started"
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    delta = export_name(2, "delta")
    assert os.path.isdir(os.path.join(root, delta)) and not is_complete(root, delta)
    reader = ServingTables(root)
    assert reader.refresh() == [export_name(1, "base")]
    rows = np.random.default_rng(0).standard_normal((1000, 8)).astype(np.float32)
    got, found = reader.lookup("emb", np.arange(1000))
    assert found.all() and np.array_equal(got, rows) and reader.ids("emb").tolist() == list(range(1000))
    # The restarted writer skips the abandoned delta; the reader follows it, prune drops the abandoned one.
    meta = {"kind": "delta", "step": 3, "previous": export_name(1, "base")}
    for k in range(2):
        write_export_shard(
            root,
            export_name(3, "delta"),
            "emb",
            k,
            2,
            np.array([k], np.int64),
            np.full((1, 8), 9, np.float32),
            np.array([k + 2], np.int64),
            meta,
        )
        finish_export_shard(root, export_name(3, "delta"), k, 2)
    assert reader.refresh() == [export_name(3, "delta")]
    got, found = reader.lookup("emb", [0, 1, 2, 3, 4])
    assert found.tolist() == [True, True, False, False, True] and (got[:2] == 9).all()
    assert prune_exports(root, keep_bases=1) == [delta]
