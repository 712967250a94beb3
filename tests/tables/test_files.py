"""TableShard files: atomic save, load into the same or another shard count, export."""

import dataclasses
import json
import os

import numpy as np
import pytest

from pserver.tables.plain_files import export_table
from pserver.tables.shard import TableShard
from tests.helpers.table_specs import grads_for, make_spec
from transpiler.layout.routing import owner_of
from transpiler.tables import TableSpec, initial_rows, shard_of


def trained_shards(spec, n_shards, steps=4, n_ids=300, seed=0):
    shards = [TableShard(spec, s, n_shards) for s in range(n_shards)]
    rng = np.random.default_rng(seed)
    for step in range(steps):
        ids = np.unique(rng.integers(-n_ids, n_ids, n_ids // 2))
        apply_split(shards, ids, grads_for(ids, spec.dim, seed + step), 0.05)
    return shards


def apply_split(shards, ids, grads, lr):
    owner = shard_of(ids, len(shards))
    for s, t in enumerate(shards):
        t.apply(ids[owner == s], grads[owner == s], lr)


def lookup_split(shards, ids):
    out = np.empty((ids.size, shards[0].spec.dim), dtype=shards[0].dtype)
    owner = shard_of(ids, len(shards))
    for s, t in enumerate(shards):
        out[owner == s] = t.lookup(ids[owner == s])
    return out


def save_all(shards, root):
    dirs = []
    for t in shards:
        d = os.path.join(root, f"shard{t.shard}")
        t.save(d)
        dirs.append(d)
    return dirs


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad", "adam"])
def test_save_load_same_shard_count(tmp_path, optimizer):
    spec = make_spec(optimizer=optimizer)
    shards = trained_shards(spec, 2)
    dirs = save_all(shards, tmp_path)
    assert sorted(os.listdir(dirs[0])) == sorted(
        ["meta.json", "ids.npy", "rows.npy", "seen_step.npy"]
        + {"sgd": [], "adagrad": ["sum.npy"], "adam": ["exp_avg.npy", "exp_avg_sq.npy"]}[optimizer]
    )
    for t in shards:
        u = TableShard.load(spec, t.shard, 2, [dirs[t.shard]])
        v = TableShard.load(spec, t.shard, 2, dirs)  # extra directories are ignored
        for w in (u, v):
            assert w.step == t.step and len(w) == len(t)
            n = len(t)
            np.testing.assert_array_equal(w.memory.ids[:n], t.memory.ids[:n])
            np.testing.assert_array_equal(w.memory.rows[:n], t.memory.rows[:n])
            for a, b in zip(w.memory.state, t.memory.state):
                np.testing.assert_array_equal(a[:n], b[:n])
    meta = json.loads(open(os.path.join(dirs[1], "meta.json")).read())
    assert meta["table"] == "emb" and meta["shard"] == 1 and meta["n_shards"] == 2
    assert meta["rows"] == len(shards[1]) and meta["step"] == 4 and meta["optimizer"] == optimizer


def test_reshard_three_to_two_keeps_rows_and_state(tmp_path):
    spec = make_spec(optimizer="adam", dim=3)
    old = trained_shards(spec, 3, steps=5, n_ids=2000)
    dirs = save_all(old, tmp_path)
    new = [TableShard.load(spec, s, 2, dirs) for s in range(2)]
    assert sum(len(t) for t in new) == sum(len(t) for t in old)
    assert all(t.step == 5 for t in new)
    probe_ids = np.arange(-2100, 2100, dtype=np.int64)
    before = lookup_split(old, probe_ids)
    np.testing.assert_array_equal(lookup_split(new, probe_ids), before)
    # the optimizer state followed the rows: one more step agrees exactly
    ids = np.unique(np.random.default_rng(9).integers(-2100, 2100, 1500))
    g = grads_for(ids, 3, 99)
    apply_split(old, ids, g, 0.01)
    apply_split(new, ids, g, 0.01)
    after = lookup_split(old, probe_ids)
    assert not np.array_equal(after, before)
    np.testing.assert_array_equal(lookup_split(new, probe_ids), after)
    # and into one shard
    one = TableShard.load(spec, 0, 1, dirs)
    np.testing.assert_array_equal(one.lookup(probe_ids), before)


def test_load_refusals(tmp_path):
    spec = make_spec(optimizer="adagrad")
    shards = trained_shards(spec, 3, steps=2)
    dirs = save_all(shards, tmp_path)
    for other, what in (
        (make_spec(name="other", optimizer="adagrad"), "name|table"),
        (make_spec(dim=5, optimizer="adagrad"), "dim"),
        (make_spec(dtype="float64", optimizer="adagrad"), "dtype"),
        (make_spec(optimizer="adam"), "optimizer"),
    ):
        with pytest.raises(ValueError, match=what):
            TableShard.load(other, 0, 3, dirs)
    with pytest.raises(ValueError, match=r"missing \[2\]"):
        TableShard.load(spec, 0, 2, dirs[:2])
    with pytest.raises(ValueError, match="needs the saved shard 1"):
        TableShard.load(spec, 1, 3, [dirs[0]])
    with pytest.raises(ValueError, match="both shard 0"):
        TableShard.load(spec, 0, 2, [dirs[0], dirs[0], dirs[1], dirs[2]])
    # an interrupted save: no meta.json
    os.unlink(os.path.join(dirs[2], "meta.json"))
    with pytest.raises(ValueError, match="no meta.json"):
        TableShard.load(spec, 2, 3, [dirs[2]])
    # a meta.json whose row count disagrees with the arrays
    meta_path = os.path.join(dirs[1], "meta.json")
    meta = json.loads(open(meta_path).read())
    meta["rows"] += 1
    open(meta_path, "w").write(json.dumps(meta))
    with pytest.raises(ValueError, match="rows"):
        TableShard.load(spec, 1, 3, [dirs[1]])
    # steps that disagree (an async save): each shard keeps its own, a re-shard takes the highest
    shards[0].apply(np.empty(0, np.int64), np.empty((0, 4), np.float32), 0.1)
    shards[0].save(dirs[0])
    shards[1].save(dirs[1])
    shards[2].save(dirs[2])
    assert TableShard.load(spec, 0, 2, dirs).step == shards[0].step == shards[1].step + 1
    assert TableShard.load(spec, 1, 3, dirs).step == shards[1].step


def test_save_replaces_previous_save(tmp_path):
    spec = make_spec()
    t = TableShard(spec, 0, 1)
    t.apply(np.array([1, 2, 3]), grads_for([1, 2, 3], 4, 0), 0.1)
    t.save(str(tmp_path))
    t.apply(np.array([4]), grads_for([4], 4, 1), 0.1)
    t.save(str(tmp_path))
    u = TableShard.load(spec, 0, 1, [str(tmp_path)])
    assert len(u) == 4 and u.step == 2
    assert not [f for f in os.listdir(tmp_path) if "tmp" in f]


def test_export_table(tmp_path):
    spec = make_spec(optimizer="adam", dim=3, seed=1234)
    shards = trained_shards(spec, 3)
    dirs = save_all(shards, tmp_path / "ckpt")
    info = export_table(dirs, str(tmp_path / "out"))
    ids = np.load(tmp_path / "out" / "emb.ids.npy")
    rows = np.load(tmp_path / "out" / "emb.rows.npy")
    assert ids.dtype == np.int64 and rows.shape == (ids.size, 3) and rows.dtype == np.float32
    assert info == json.loads((tmp_path / "out" / "emb.json").read_text())
    assert info["name"] == "emb" and info["rows"] == ids.size == sum(len(t) for t in shards)
    assert (
        info["seed"] == 1234 and info["init"] == "normal" and info["dim"] == 3 and info["init_version"] == 2
    )
    np.testing.assert_array_equal(rows, lookup_split(shards, ids))
    # ids absent from the export are reproduced from the json alone
    again = TableSpec.from_dict(info["spec"])
    missing = np.setdiff1d(np.arange(-400, 400), ids)
    np.testing.assert_array_equal(initial_rows(again, missing), lookup_split(shards, missing))
    with pytest.raises(ValueError, match=r"missing shards \[1\]"):
        export_table([dirs[0], dirs[2]], str(tmp_path / "out2"))


def test_shards_saved_before_init_versions_read_as_version_1(tmp_path, caplog):
    """A shard (and its export) whose saved spec has no init_version was written with version 1."""
    spec = dataclasses.replace(make_spec(dim=3, seed=5), init_version=1)
    shards = trained_shards(spec, 2)
    dirs = save_all(shards, tmp_path / "ckpt")
    for d in dirs:  # as a save from before versions wrote it
        meta = json.loads(open(os.path.join(d, "meta.json")).read())
        del meta["spec"]["init_version"]
        with open(os.path.join(d, "meta.json"), "w") as f:
            json.dump(meta, f)
    info = export_table(dirs, str(tmp_path / "out"))
    assert info["init_version"] == 1 and TableSpec.from_dict(info["spec"]).init_version == 1
    missing = np.setdiff1d(np.arange(-400, 400), np.load(tmp_path / "out" / "emb.ids.npy"))
    np.testing.assert_array_equal(
        initial_rows(TableSpec.from_dict(info["spec"]), missing), lookup_split(shards, missing)
    )
    with caplog.at_level("WARNING"):
        TableShard.load(spec, 0, 2, dirs)  # the same definition: nothing to say
    assert "init_version" not in caplog.text
    with caplog.at_level("WARNING"):
        TableShard.load(dataclasses.replace(spec, init_version=2), 0, 2, dirs)
    assert "('normal', 5, 1), now ('normal', 5, 2)" in caplog.text


def test_a_save_placed_by_routing_version_1_loads_re_routed_into_the_same_shard_count(tmp_path):
    """Files saved before routing version 2 placed ids by ``stable_hash % n``: loading them into as many
    shards reads every saved shard and keeps the ids today's routing gives each, with their state."""
    spec = make_spec(optimizer="adagrad", dim=3)
    (whole,) = trained_shards(spec, 1, steps=5, n_ids=2000)
    (one,) = save_all([whole], tmp_path / "one")
    meta = json.loads(open(os.path.join(one, "meta.json")).read())
    arrays = {name: np.load(os.path.join(one, f"{name}.npy")) for name in meta["arrays"]}
    v1_owner = owner_of(arrays["ids"], 2, version=1)
    dirs = []
    for k in range(2):  # what a version-1 save of two shards wrote: no "routing" in its meta
        d = tmp_path / f"v1-shard{k}"
        d.mkdir()
        for name, a in arrays.items():
            np.save(d / f"{name}.npy", a[v1_owner == k])
        saved = {key: value for key, value in meta.items() if key != "routing"}
        saved.update(shard=k, n_shards=2, rows=int((v1_owner == k).sum()))
        (d / "meta.json").write_text(json.dumps(saved))
        dirs.append(str(d))
    assert not np.array_equal(v1_owner, shard_of(arrays["ids"], 2))  # the versions place ids differently
    new = [TableShard.load(spec, k, 2, dirs) for k in range(2)]
    assert [len(t) for t in new] == np.bincount(shard_of(arrays["ids"], 2), minlength=2).tolist()
    probe_ids = np.arange(-2100, 2100, dtype=np.int64)
    np.testing.assert_array_equal(lookup_split(new, probe_ids), whole.lookup(probe_ids))
    with pytest.raises(ValueError, match=r"routing 1 -> 2\) needs every saved shard"):
        TableShard.load(spec, 0, 2, dirs[:1])
    (d0,) = save_all(new[:1], tmp_path / "v2")
    assert json.loads(open(os.path.join(d0, "meta.json")).read())["routing"] == 2
