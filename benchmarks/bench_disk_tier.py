"""Job S with its table 4x its RAM budget (the disk tier) against the same job all in RAM.

    python -m benchmarks.bench_disk_tier [--rounds 3] [--factor 4] [--async]

Job S (``benchmarks/jobs/job_s.py``: 26 Zipf(1.2) id slots into one dim-16 table, 2 pservers x 2
trainers, sync unless ``--async``) runs first all in RAM to learn how many rows the table ends
with; then, in alternating rounds, all in RAM and with ``ram_rows`` = rows / ``--factor``, the
rest in each pserver's LMDB disk tier (under the run's work directory, on this machine's disk).
Prints examples/s of each (median [min-max] over rounds), the per-round ratio, the rows held in
memory and on disk at the end, and the AUC of both (the same model either way).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

from benchmarks.common.paths import DEFAULT_PEERS
from benchmarks.common.peer_runners import run_ours_s
from benchmarks.reports.dense import med


def run(args, work: str, name: str, ram_rows: int = 0) -> dict:
    """One job S run in its own work directory."""
    os.makedirs(os.path.join(work, name))
    return run_ours_s(args, os.path.join(work, name), args.sync, ram_rows=ram_rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of both (default %(default)s)")
    p.add_argument("--factor", type=float, default=4.0, help="table rows / RAM budget (default 4)")
    p.add_argument("--async", dest="sync", action="store_false", help="asynchronous updates (default sync)")
    p.add_argument(
        "--peers", default=DEFAULT_PEERS, help="the peers' folder, for jobs.py (default: %(default)s)"
    )
    p.add_argument("--s_warmup", type=int, default=20, help="job S warm-up steps (default %(default)s)")
    p.add_argument("--s_steps", type=int, default=200, help="job S timed steps (default %(default)s)")
    p.add_argument("--s_batch", type=int, default=512, help="job S batch per trainer (default %(default)s)")
    p.add_argument("--s_eval", type=int, default=20000, help="job S hold-out examples (default %(default)s)")
    p.add_argument(
        "--timeout", type=float, default=900, help="deadline of one run in s (default %(default)s)"
    )
    args = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="bench-disk-tier-")
    first = run(args, work, "probe")
    rows = sum(s["table_rows"] for s in first["detail"][0]["ps_stats"].values())
    ram_rows = int(rows / args.factor)
    print(f"table rows after the job: {rows:,}; ram_rows = {ram_rows:,} (1/{args.factor:g})", flush=True)
    runs = {"ram": [], "tiered": []}
    for r in range(args.rounds):
        for name in ("ram", "tiered") if r % 2 == 0 else ("tiered", "ram"):
            res = run(args, work, f"{name}-{r}", ram_rows if name == "tiered" else 0)
            runs[name].append(res)
            print(f"round {r} {name}: {res['examples_s']:,.0f} examples/s, auc {res['auc']:.4f}", flush=True)
    ratios = [t["examples_s"] / m["examples_s"] for t, m in zip(runs["tiered"], runs["ram"])]
    stats = runs["tiered"][-1]["detail"][0]["ps_stats"]
    print(
        f"\njob S, {'sync' if args.sync else 'async'}, 2 ps x 2 trainers, nproc {os.cpu_count()}, "
        f"{args.rounds} alternating rounds\n"
    )
    print("| configuration | examples/s | AUC | rows in RAM (end) | rows on disk (end) |")
    print("|---|---|---|---|---|")
    speed = {name: med([r["examples_s"] for r in rs], ",.0f") for name, rs in runs.items()}
    print(
        f"| all in RAM | {speed['ram']} | "
        f"{statistics.median(r['auc'] for r in runs['ram']):.4f} | {rows:,} | 0 |"
    )
    disk = sum(s.get("disk_rows", 0) for s in stats.values())
    print(
        f"| ram_rows = rows / {args.factor:g} | {speed['tiered']} | "
        f"{statistics.median(r['auc'] for r in runs['tiered']):.4f} | "
        f"{sum(s['table_rows'] for s in stats.values()) - disk:,} | {disk:,} |"
    )
    print(
        f"\ntiered / all in RAM per round: {', '.join(f'{x:.2f}' for x in ratios)} "
        f"(median {statistics.median(ratios):.2f})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
