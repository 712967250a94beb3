"""A change of pserver count on a live table: rows moved against the ideal, and what the move costs, beside
the route users take today (a checkpoint saved and loaded into the new count).

    python -m benchmarks.bench_reshard [--rows 2000000] [--changes 2:3,3:2,4:5] [--optimizer sgd] [--runs 3]

One process holds every shard of one dim-16 table of ``--rows`` rows (job S's table: ids ``slot << 40 |
z``, SGD; ``--optimizer adagrad`` adds its state). For each change ``P:P'``, alternating in ``--runs``
rounds: **move**: the moving slots' rows taken from each sender, put into each receiver and dropped from
the sender (``pserver.layout.slot_moves``); **checkpoint**: every shard saved, then every new shard loaded
re-sharded from all of them (``TableShard.save`` / ``load``), as a job restarted at the new count does.
Reports the fraction of rows moved (ideal ``|P' - P| / max(P, P')``), the bytes moved, and seconds: in
total and on the busiest pserver (the pservers of a real change work in parallel, so that is the change's
critical path, wire aside). Writes ``results/reshard-<date>.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Dict, List

import numpy as np

from benchmarks.bench_table import DIM, spec_for
from benchmarks.common.machine import OtherLoad, cpu_model
from benchmarks.common.paths import dated_result
from pserver.layout.slot_moves import drop_slots, put_slots, slot_mask, take_slots
from pserver.tables.shard import TableShard
from transpiler.layout.moves import slots_between
from transpiler.tables import TableSpec, shard_of

_BATCH = 500_000


def filled(table: TableSpec, n_shards: int, rows: int) -> List[TableShard]:
    """``n_shards`` shards holding ``rows`` job-S-like ids between them, each updated once."""
    shards = [TableShard(table, k, n_shards) for k in range(n_shards)]
    rng = np.random.default_rng(0)
    for start in range(0, rows, _BATCH):
        z = np.arange(start, min(rows, start + _BATCH), dtype=np.int64)
        ids = (z % 26) << 40 | z
        grads = rng.standard_normal((ids.size, DIM)).astype(np.float32)
        owner = shard_of(ids, n_shards)
        for s in shards:
            s.apply(ids[owner == s.shard], grads[owner == s.shard], 0.05)
    return shards


def move(shards: List[TableShard], n_next: int) -> Dict[str, float]:
    """The live move; seconds per pserver (sent + received) and rows, bytes moved."""
    n_now = len(shards)
    out = shards[:n_next] + [TableShard(shards[0].spec, k, n_next) for k in range(n_now, n_next)]
    busy = [0.0] * max(n_now, n_next)
    rows = nbytes = 0
    for (a, b), slots in slots_between(n_now, n_next).items():
        mask = slot_mask(slots)
        t0 = time.perf_counter()
        moved = take_slots(shards[a], mask)
        t1 = time.perf_counter()
        put_slots(out[b], mask, moved)
        t2 = time.perf_counter()
        drop_slots(shards[a], mask)
        t3 = time.perf_counter()
        busy[a] += (t1 - t0) + (t3 - t2)
        busy[b] += t2 - t1
        rows += moved.ids.size
        nbytes += moved.nbytes
    step = max(s.step for s in shards)
    for k, s in enumerate(out):
        s.relabel(k, n_next, step)
    shards[:] = out
    return {"rows": rows, "bytes": nbytes, "total_s": sum(busy), "busiest_s": max(busy)}


def checkpoint(shards: List[TableShard], n_next: int) -> Dict[str, float]:
    """Save every shard, load the new count from all of them; seconds per pserver."""
    with tempfile.TemporaryDirectory(prefix="bench-reshard-") as root:
        dirs, busy_save = [], []
        for s in shards:
            t0 = time.perf_counter()
            d = f"{root}/shard-{s.shard}"
            s.save(d)
            busy_save.append(time.perf_counter() - t0)
            dirs.append(d)
        busy_load, out = [], []
        for k in range(n_next):
            t0 = time.perf_counter()
            out.append(TableShard.load(shards[0].spec, k, n_next, dirs))
            busy_load.append(time.perf_counter() - t0)
    shards[:] = out
    total = sum(busy_save) + sum(busy_load)
    return {"total_s": total, "busiest_s": max(busy_save) + max(busy_load)}


def main(argv=None) -> None:
    """Run the rounds; print a markdown table; write the JSON result."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2_000_000)
    ap.add_argument("--changes", default="2:3,3:2,4:5")
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adagrad", "adam"])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    changes = [tuple(int(x) for x in c.split(":")) for c in args.changes.split(",")]
    table = spec_for(args.optimizer, args.rows)  # bench_table's: dim 16, float32, N(0, 1) rows
    results: Dict[str, dict] = {}
    with OtherLoad() as load:
        for now, nxt in changes:
            runs: Dict[str, List[dict]] = {"move": [], "checkpoint": []}
            for r in range(args.runs):
                for how in ("move", "checkpoint") if r % 2 == 0 else ("checkpoint", "move"):
                    shards = filled(table, now, args.rows)
                    runs[how].append((move if how == "move" else checkpoint)(shards, nxt))
                    held = sum(s.rows_held for s in shards)
                    assert held == args.rows, (how, held)
            results[f"{now}:{nxt}"] = runs
    print(
        f"{args.rows:,} rows of dim {DIM}, {args.optimizer}; {cpu_model()}; other load {load.cores:.2f} cores"
    )
    print(
        "| change | rows moved | ideal | MB moved | move: busiest pserver, s | move: all, s |"
        " checkpoint route: busiest, s | checkpoint route: all, s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for key, runs in results.items():
        now, nxt = (int(x) for x in key.split(":"))
        m, c = runs["move"], runs["checkpoint"]

        def med(rs, k):
            return statistics.median(r[k] for r in rs)

        print(
            f"| {now} -> {nxt} | {m[0]['rows'] / args.rows:.3f} | {abs(nxt - now) / max(now, nxt):.3f} | "
            f"{m[0]['bytes'] / 1e6:.0f} | {med(m, 'busiest_s'):.2f} | {med(m, 'total_s'):.2f} | "
            f"{med(c, 'busiest_s'):.2f} | {med(c, 'total_s'):.2f} |"
        )
    out = dated_result("reshard")
    with open(out, "w") as f:
        json.dump(
            {"rows": args.rows, "optimizer": args.optimizer, "cpu": cpu_model(), "changes": results},
            f,
            indent=1,
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
