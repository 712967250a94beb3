"""Distributed-table shard alone: memory per row, row lookups/s and updates/s, with two peers.

    python -m benchmarks.bench_table [--runs 5] [--table_rows 10000000] [--batch 100000]
    python -m benchmarks.bench_table --rows 50000000 [--runs 5]

Default mode, for dim 16 float32 and each of SGD and Adam (SparseAdam): fill one
``pserver.tables.shard.TableShard`` with ``--table_rows`` rows by ``apply()`` of batches of
1M new ids, then report bytes per stored row (``nbytes / len``) against raw
(8-byte id + values + optimizer state), and the medians over ``--runs`` of row
lookups/s (``--batch`` existing ids, drawn with repeats; a run is the mean of 10 calls)
and updates/s (``--batch`` unique ids, half stored, half new: one call per run;
all stored: 10 calls per run). In the same
process, the peers for lookups of the same batch on as many rows: a dense
``nn.Embedding`` forward (index_select; the best a dense in-memory table can do,
1 thread as a pserver runs it, and all threads) and a Python dict of rows (what
a naive table does), with the dict's memory per row from the RSS it added.

``--rows N`` mode: one process fills a single SGD shard with N rows (batches of
1M new ids) and reports peak RSS (VmHWM), bytes per row and lookups/s at N rows.

Prints markdown tables, the machine (nproc, CPU model) and the other load on
the machine during the run (busy CPU from /proc/stat minus this process's own).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

from benchmarks.common.machine import OtherLoad, cpu_model
from pserver.tables.shard import TableShard
from transpiler.tables import TableOptimizerSpec, TableSpec

DIM = 16
FILL_BATCH = 1_000_000
_SCRAMBLE = np.uint64(0x9E3779B97F4A7C15)  # odd: i -> i * c is a bijection of int64


def id_of(i: np.ndarray) -> np.ndarray:
    """The i-th distinct id: arbitrary-looking int64 (negative too), no repeats."""
    with np.errstate(over="ignore"):
        return (np.asarray(i, dtype=np.uint64) * _SCRAMBLE).view(np.int64)


def spec_for(optimizer: str, rows: int) -> TableSpec:
    return TableSpec(
        name="emb",
        dim=DIM,
        dtype="float32",
        kind="embedding",
        capacity=rows,
        seed=1,
        init="normal",
        init_kwargs={"mean": 0.0, "std": 1.0},
        optimizer=TableOptimizerSpec(optimizer, {}),
    )


def status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def fill(table: TableShard, n: int) -> float:
    """Insert ids id_of(0..n) by apply() in batches of 1M; rows/s."""
    zero = np.zeros((FILL_BATCH, DIM), np.float32)
    t0 = time.perf_counter()
    for a in range(len(table), n, FILL_BATCH):
        b = min(n, a + FILL_BATCH)
        table.apply(id_of(np.arange(a, b)), zero[: b - a], 0.01)
    return n / (time.perf_counter() - t0)


REPS = 10  # calls per timed run, each on its own batch: smooths scheduler noise


def timed(fn, runs, reps=REPS):
    """(median, min, max) over ``runs`` of the mean seconds of ``reps`` calls fn(i)."""
    ts = []
    for r in range(runs):
        t0 = time.perf_counter()
        for i in range(reps):
            fn(r * reps + i)
        ts.append((time.perf_counter() - t0) / reps)
    return statistics.median(ts), min(ts), max(ts)


def batches(make, runs, reps=REPS):
    """Inputs for every call of :func:`timed`, made beforehand (not timed)."""
    return [make() for _ in range(runs * reps + 1)]


def rate(n, t):
    """'12.3M [min-max]' items/s from (median, min, max) seconds."""
    med, lo, hi = t
    return f"{n / med / 1e6:.2f}M [{n / hi / 1e6:.2f}-{n / lo / 1e6:.2f}]"


def bench_table(optimizer: str, n_rows: int, batch: int, runs: int, rng) -> dict:
    table = TableShard(spec_for(optimizer, n_rows), 0, 1)
    fill_rate = fill(table, n_rows)
    bpr = table.nbytes / len(table)
    raw = table.raw_bytes_per_row
    lookups = batches(lambda: id_of(rng.integers(0, n_rows, batch)), runs)
    table.lookup(lookups[-1])  # warm
    t_lookup = timed(lambda r: table.lookup(lookups[r]), runs)
    grads = rng.standard_normal((batch, DIM)).astype(np.float32)
    next_new = [len(table)]

    def mixed(r):
        old = id_of(rng.choice(n_rows, batch // 2, replace=False))
        new = id_of(np.arange(next_new[0], next_new[0] + batch - batch // 2))
        next_new[0] += new.size
        ids = np.concatenate([old, new])
        t0 = time.perf_counter()
        table.apply(ids, grads, 0.01)
        return time.perf_counter() - t0

    def existing(r):
        ids = id_of(rng.choice(n_rows, batch, replace=False))
        t0 = time.perf_counter()
        table.apply(ids, grads, 0.01)
        return time.perf_counter() - t0

    def only_apply(fn, reps):  # id generation is not the table's time
        ts = [sum(fn(r) for _ in range(reps)) / reps for r in range(runs)]
        return statistics.median(ts), min(ts), max(ts)

    # One apply per run with new ids: more would grow the table past a rebuild.
    t_mixed = only_apply(mixed, 1)
    t_existing = only_apply(existing, REPS)
    # The table goes with this frame (the caller collects): the next one is measured without it.
    return {
        "optimizer": optimizer,
        "rows": len(table),
        "bytes_per_row": bpr,
        "raw": raw,
        "fill": fill_rate,
        "lookup": t_lookup,
        "update_mixed": t_mixed,
        "update_existing": t_existing,
        "capacity": table.capacity,
        "slots": table.memory.index_slots,
    }


def bench_embedding(n_rows: int, batch: int, runs: int, rng) -> dict:
    """Lookups of a dense ``nn.Embedding`` of ``n_rows`` rows, 1 thread and all: {"torch_<threads>":
    times}."""
    res = {}
    emb = torch.nn.Embedding.from_pretrained(torch.randn(n_rows, DIM), freeze=True)
    idx = batches(lambda: torch.from_numpy(rng.integers(0, n_rows, batch)), runs)
    threads = torch.get_num_threads()
    with torch.no_grad():
        for n_threads in sorted({1, threads}):
            torch.set_num_threads(n_threads)
            emb(idx[-1])
            res[f"torch_{n_threads}"] = timed(lambda r: emb(idx[r]), runs)
    torch.set_num_threads(threads)
    return res


def bench_dict(n_rows: int, batch: int, runs: int, rng) -> dict:
    """A Python dict id -> numpy row: its build time, the RSS it added per row, and its lookups."""
    res = {}
    rss0 = status_kb("VmRSS")
    t0 = time.perf_counter()
    rows = np.random.default_rng(0).standard_normal((n_rows, DIM)).astype(np.float32)
    table = dict(zip(id_of(np.arange(n_rows)).tolist(), (row.copy() for row in rows)))
    del rows  # only the dict's own rows count in its RSS
    gc.collect()
    res["dict_build_s"] = time.perf_counter() - t0
    res["dict_bytes_per_row"] = (status_kb("VmRSS") - rss0) * 1024 / n_rows
    keys = batches(lambda: id_of(rng.integers(0, n_rows, batch)).tolist(), runs, 1)
    res["dict"] = timed(lambda r: np.stack([table[k] for k in keys[r]]), runs, 1)
    return res


def bench_peers(n_rows: int, batch: int, runs: int, rng) -> dict:
    """The peers of a TableShard lookup on as many rows, each measured after the previous one's memory is
    freed."""
    res = bench_embedding(n_rows, batch, runs, rng)
    gc.collect()  # the embedding's weight is gone before the dict's RSS is measured
    res.update(bench_dict(n_rows, batch, runs, rng))
    gc.collect()
    return res


def machine() -> str:
    model = cpu_model()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"nproc {os.cpu_count()}, {model}, {mem:.0f} GiB, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5, help="timed runs, median [min-max] (default %(default)s)")
    ap.add_argument(
        "--batch", type=int, default=100_000, help="ids per lookup or update (default %(default)s)"
    )
    ap.add_argument("--table_rows", type=int, default=10_000_000, help="rows of the default mode's tables")
    ap.add_argument("--rows", type=int, default=0, help="big mode: fill one SGD shard with this many rows")
    ap.add_argument(
        "--optimizers", default="sgd,adam", help="the default mode's tables (default %(default)s)"
    )
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {' '.join(['python -m benchmarks.bench_table'] + sys.argv[1:])}")
    print(f"# {started:%Y-%m-%d %H:%M} UTC; {machine()}; load average before {os.getloadavg()[0]:.2f}")

    if args.rows:
        rss0 = status_kb("VmRSS") * 1024
        with OtherLoad() as load:
            table = TableShard(spec_for("sgd", args.rows), 0, 1)
            t0 = time.perf_counter()
            fill_rate = fill(table, args.rows)
            fill_s = time.perf_counter() - t0
            lookups = batches(lambda: id_of(rng.integers(0, args.rows, args.batch)), args.runs)
            table.lookup(lookups[-1])
            t_lookup = timed(lambda r: table.lookup(lookups[r]), args.runs)
        print()
        print(
            f"| rows | fill (apply of 1M new ids) | peak RSS (VmHWM) | RSS / row | bytes/row (nbytes) "
            f"| raw | lookups/s ({args.batch // 1000}k ids, median [min-max] of {args.runs}) |"
        )
        print("|---|---|---|---|---|---|---|")
        hwm = status_kb("VmHWM") * 1024
        print(
            f"| {len(table):,} | {fill_s:.0f} s ({fill_rate / 1e6:.2f}M rows/s) | {hwm / 2**30:.2f} GiB | "
            f"{hwm / len(table):.1f} B | {table.nbytes / len(table):.1f} B "
            f"({table.nbytes / len(table) / table.raw_bytes_per_row:.2f}x) | {table.raw_bytes_per_row} B | "
            f"{rate(args.batch, t_lookup)} |"
        )
        print(
            f"\nprocess RSS before the table {rss0 / 2**20:.0f} MiB (interpreter, torch, numpy); "
            f"capacity {table.capacity:,} rows, index {table.memory.index_slots:,} slots; "
            f"other load during the run: {load.cores:.2f} cores"
        )
        return

    with OtherLoad() as load:
        tables = []
        for o in args.optimizers.split(","):
            tables.append(bench_table(o, args.table_rows, args.batch, args.runs, rng))
            gc.collect()  # the shard just measured is freed before the next is filled
        peers = bench_peers(args.table_rows, args.batch, args.runs, rng)
    n, b = args.table_rows, args.batch
    print()
    print(
        f"| table (dim {DIM} float32, {n / 1e6:g}M rows) | bytes/row | raw | ratio | "
        f"fill: new rows/s | lookups/s | updates/s (50% new) | updates/s (stored) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in tables:
        print(
            f"| TableShard {r['optimizer']} | {r['bytes_per_row']:.1f} | {r['raw']} | "
            f"**{r['bytes_per_row'] / r['raw']:.2f}x** | {r['fill'] / 1e6:.2f}M | "
            f"**{rate(b, r['lookup'])}** | {rate(b, r['update_mixed'])} | "
            f"{rate(b, r['update_existing'])} |"
        )
    print()
    print(f"| lookup of {b // 1000}k ids among {n / 1e6:g}M rows of dim {DIM} | lookups/s | bytes/row |")
    print("|---|---|---|")
    for r in tables:
        print(
            f"| TableShard ({r['optimizer']}), numpy open addressing | {rate(b, r['lookup'])} | "
            f"{r['bytes_per_row']:.1f} |"
        )
    for k in sorted(x for x in peers if x.startswith("torch_")):
        t = k.split("_")[1]
        print(
            f"| dense nn.Embedding forward (index_select), {t} thread{'s' if t != '1' else ''} | "
            f"{rate(b, peers[k])} | {DIM * 4} (ids 0..n-1 only) |"
        )
    print(
        f"| Python dict id -> numpy row, np.stack | {rate(b, peers['dict'])} | "
        f"{peers['dict_bytes_per_row']:.0f} (RSS added; built in {peers['dict_build_s']:.0f} s) |"
    )
    print(
        f"\nmedian [min-max] of {args.runs} runs; other load during the run: {load.cores:.2f} cores; "
        f"load average after {os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
