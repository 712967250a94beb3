"""A job S push's table work on one pserver's shard: CPU per apply and per lookup, numpy against compiled.

    python -m benchmarks.bench_table_push [--steps 200] [--rounds 20] [--peers ../shared/peers]

The shard is job S's (``benchmarks/jobs/job_s.py``): one dim-16 float32 table, SGD lr 0.05, rows
N(0, 0.01^2), shard 0 of 2 pservers, 2 trainers. Trainer ``r``'s push at step ``t`` applies the
gradients of the ids of ``jobs.ctr_batch(t * 2 + r, batch=512)`` that live on this shard (about
3,090, a third of them new) and looks up those of its next batch, as a PushPull's answer does; 20
warm-up steps, then ``--steps`` timed. The same pushes go to each variant, in ``--rounds``
alternating rounds (the order of the variants rotates):

- ``numpy, v1``: the path before compiled tables (``TableShard.compiled`` off): the id index compiled,
  gather, the numpy rules, scatter; version 1's initial rows (numpy's log and cos), kept from the lookup
  for the apply;
- ``compiled, v1``: each apply and lookup one compiled call; version 1's rows still computed by numpy;
- ``compiled, v2``: and version 2's initial rows (the default), computed after the lookup released
  the lock, and again in the apply's kernel.

Then the initial rows alone: 950 new ids of dim 16 (job S's new ids per push) by each definition, CPU
per call, alternating. Figures are thread CPU time (``time.thread_time``), median over calls [min-max
of the rounds' medians]; prints markdown tables.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import numpy as np

from benchmarks.common.machine import cpu_model
from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from benchmarks.jobs.job_s_program import shard_batch_ids
from pserver.tables.fresh import initial_rows_compiled
from pserver.tables.shard import TableShard
from transpiler.tables import TableOptimizerSpec, TableSpec, initial_rows

TRAINERS, PSERVERS, WARMUP = 2, 2, 20
VARIANTS = ("numpy, v1", "compiled, v1", "compiled, v2")


def job_s_spec(version: int) -> TableSpec:
    """Job S's table (one shard of it)."""
    return TableSpec(
        name="emb",
        dim=16,
        dtype="float32",
        kind="embedding",
        capacity=26_000_000,
        seed=1,
        init="normal",
        init_kwargs={"mean": 0.0, "std": 0.01},
        optimizer=TableOptimizerSpec("sgd", {}),
        init_version=version,
    )


def variant(name: str) -> TableShard:
    t = TableShard(job_s_spec(2 if "v2" in name else 1), 0, PSERVERS)
    if name.startswith("numpy"):
        t.compiled = None
    return t


def pushes(jobs, steps: int) -> list:
    """(ids, gradient rows, next ids) of every push to shard 0, in arrival order."""
    rng = np.random.default_rng(0)
    out = []
    for t in range(WARMUP + steps):
        for r in range(TRAINERS):
            ids = shard_batch_ids(jobs, t * TRAINERS + r, PSERVERS)
            grads = (rng.standard_normal((ids.size, 16)) * 1e-3).astype(np.float32)
            out.append((ids, grads, shard_batch_ids(jobs, (t + 1) * TRAINERS + r, PSERVERS)))
    return out


def cpu_us(fn) -> float:
    t0 = time.thread_time_ns()
    fn()
    return (time.thread_time_ns() - t0) / 1e3


def summary(calls: list, rounds: list) -> str:
    """'median [min-max of the rounds' medians]' in µs."""
    meds = [statistics.median(r) for r in rounds]
    return f"{statistics.median(calls):.0f} [{min(meds):.0f}-{max(meds):.0f}]"


def bench_pushes(jobs, steps: int, n_rounds: int) -> None:
    work = pushes(jobs, steps)
    tables = {name: variant(name) for name in VARIANTS}
    new = []
    for ids, grads, nxt in work[: WARMUP * TRAINERS]:
        for t in tables.values():
            t.apply(ids, grads, 0.05)
            t.lookup(nxt)
    timed = work[WARMUP * TRAINERS :]
    per_round = -(-len(timed) // n_rounds)
    got = {name: {"apply": [], "lookup": []} for name in VARIANTS}
    for k in range(n_rounds):
        part = timed[k * per_round : (k + 1) * per_round]
        order = VARIANTS[k % len(VARIANTS) :] + VARIANTS[: k % len(VARIANTS)]
        for name in order:
            t, a, lk = tables[name], [], []
            for ids, grads, nxt in part:
                if name == VARIANTS[0]:
                    new.append(int((t.memory.find(ids)[0] < 0).sum()))
                a.append(cpu_us(lambda: t.apply(ids, grads, 0.05)))
                lk.append(cpu_us(lambda: t.lookup(nxt)))
            got[name]["apply"].append(a)
            got[name]["lookup"].append(lk)
    every = np.concatenate([p[0] for p in work])
    rows = {name: t.lookup(every).tobytes() for name, t in tables.items()}
    same = rows[VARIANTS[0]] == rows[VARIANTS[1]]
    print(
        f"\n{len(timed)} pushes to shard 0 of {PSERVERS} after {WARMUP} warm-up steps: "
        f"{np.median([p[0].size for p in timed]):.0f} ids each (median), {np.median(new):.0f} of them new; "
        f"{len(tables[VARIANTS[0]]):,} rows at the end; {n_rounds} alternating rounds"
    )
    print("\n| path | apply, µs CPU | lookup of the next ids, µs CPU | both |")
    print("|---|---|---|---|")
    for name in VARIANTS:
        a, lk = got[name]["apply"], got[name]["lookup"]
        both = [x + y for ra, rl in zip(a, lk) for x, y in zip(ra, rl)]
        rounds_both = [[x + y for x, y in zip(ra, rl)] for ra, rl in zip(a, lk)]
        flat = lambda rs: [x for r in rs for x in r]  # noqa: E731
        print(f"| {name} | {summary(flat(a), a)} | {summary(flat(lk), lk)} | {summary(both, rounds_both)} |")
    print(f"\nevery row pushed, compiled v1's equal to numpy v1's: {same}")


def bench_initial_rows(n_rounds: int, calls: int = 50) -> None:
    ids = np.random.default_rng(3).integers(-(2**63), 2**63 - 1, size=950, dtype=np.int64)
    v1, v2 = job_s_spec(1), job_s_spec(2)
    out = np.empty((950, 16), np.float32)
    ways = {
        "v1, numpy (the definition)": lambda: initial_rows(v1, ids),
        "v1, compiled hashing + numpy log/cos (before)": lambda: initial_rows_compiled(v1, ids, out),
        "v2, numpy (the definition)": lambda: initial_rows(v2, ids),
        "v2, compiled": lambda: initial_rows_compiled(v2, ids, out),
    }
    for fn in ways.values():
        fn()
    got = {name: [] for name in ways}
    for k in range(n_rounds):
        names = list(ways)[k % len(ways) :] + list(ways)[: k % len(ways)]
        for name in names:
            got[name].append([cpu_us(ways[name]) for _ in range(calls)])
    print("\n| initial rows of 950 ids x dim 16 (job S's new ids per push) | µs CPU per call |")
    print("|---|---|")
    for name, rounds in got.items():
        print(f"| {name} | {summary([x for r in rounds for x in r], rounds)} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="timed steps of 2 trainers (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=20, help="alternating rounds (default %(default)s)")
    ap.add_argument(
        "--peers", default=DEFAULT_PEERS, help="the peers' folder, for jobs.py (default %(default)s)"
    )
    args = ap.parse_args()
    jobs = peer_module(args.peers, "jobs")
    started = datetime.datetime.now(datetime.timezone.utc)
    print(f"# {' '.join(['python -m benchmarks.bench_table_push'] + sys.argv[1:])}")
    print(
        f"# {started:%Y-%m-%d %H:%M} UTC; nproc {os.cpu_count()}, {cpu_model()}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    bench_pushes(jobs, args.steps, args.rounds)
    bench_initial_rows(args.rounds)
    print(f"\nload average after {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
