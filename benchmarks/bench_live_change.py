"""A live change of pserver count on job S: how long the steps around each change take.

    python -m benchmarks.bench_live_change [--steps 120] [--changes 40,80] [--rounds 3]

Job S (``benchmarks/jobs/job_s_program.py``: one dim-16 table of Zipf ids, the MLP, batch 512) trains sync
with 2 trainers, its pservers 2 -> 3 -> 2 at the steps of ``--changes`` (asked as ``ps-reshard`` asks,
the new pserver started once asked), every role a thread of this process (one torch thread each), its
checkpoint_dir on local disk. Per round: the median step (forward, backward and ``tr.step()``) away from
the changes, the longest step of each trainer within five steps of each ask (where the switch lands:
the pservers write and load the switch step's checkpoint, the trainers adopt the next layout), the
table's rows, and how long each change took from the ask to the commit. A round alternates with one that
makes no change (the same steps): its longest step over the same window is the baseline the machine's
noise gives. No peer changes a running job's pserver count (TorchRec, Paddle and TensorFlow restart from a
checkpoint): the figure to beat is a restart of every role.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List

import torch
from torch import nn

from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from benchmarks.jobs.job_s_program import TABLE, build_program, make_batches
from harness.cluster import in_threads
from harness.ports import free_ports
from pserver import ParameterServer
from pserver.layout.reshard_cli import ask_change
from pserver.layout.stores import FileLayoutStore
from psproto.security import Security
from trainer import Trainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

TRAINERS = 2
WINDOW = 5  # steps after a change's ask within which its switch lands (two or three past the first pserver)


def one_round(jobs, steps: int, changes: List[int], batch: int, change: bool) -> dict:
    """One run of job S; its step times, the table's rows and each change's ask-to-commit seconds."""
    directory = tempfile.mkdtemp(prefix="bench-live-change-")
    config = DistributeTranspilerConfig(checkpoint_dir=directory)
    a, b, c = (f"127.0.0.1:{p}" for p in free_ports(3))
    store = FileLayoutStore(directory)
    servers: List[threading.Thread] = []

    def transpiler(pservers, trainer_id: int = 0) -> DistributeTranspiler:
        t = DistributeTranspiler(config)
        t.transpile(trainer_id, build_program(jobs), ",".join(pservers), TRAINERS)
        return t

    def start_pserver(endpoint: str, pservers) -> None:
        t = transpiler(pservers)
        program = t.get_pserver_program(endpoint)
        startup = t.get_startup_program(endpoint, program)
        thread = threading.Thread(
            target=lambda: ParameterServer(program, startup, security=Security()).serve(), daemon=True
        )
        thread.start()
        servers.append(thread)

    for ep in (a, b):
        start_pserver(ep, [a, b])
    targets = {changes[0]: [a, b, c], changes[1]: [a, b]}
    asked: List[dict] = []

    def ask(pservers) -> None:
        record = ask_change(store, pservers, timeout=120)
        asked.append({"pservers": len(record.pservers), "ask_to_commit_s": record.last_change_s})

    def body(i: int) -> Dict[str, object]:
        data = make_batches(jobs, i, TRAINERS, steps, batch, 0)
        times, asking = [], None
        with Trainer(transpiler([a, b], i).get_trainer_program(), Security()) as tr:
            torch.set_num_threads(1)
            loss_fn = nn.BCEWithLogitsLoss()
            for k, (ids, dense, y) in enumerate(tr.batches(data, 1, prefetch=lambda bt: {TABLE: bt[0]})):
                started = time.perf_counter()
                loss_fn(tr.model(ids, dense), y).backward()
                tr.step()
                times.append(time.perf_counter() - started)
                if change and i == 0 and k in targets:
                    if asking is not None:
                        asking.join(120)
                    asking = threading.Thread(target=ask, args=(targets[k],), daemon=True)
                    asking.start()
                    if targets[k] == [a, b, c]:
                        while store.read().change is None and asking.is_alive():
                            time.sleep(0.005)
                        start_pserver(c, [a, b, c])
            if asking is not None:
                asking.join(120)
            rows = sum(s.table_rows for s in tr.channels.stats(10).values() if hasattr(s, "table_rows"))
        return {"times": times, "rows": rows, "epoch": tr.program.layout_epoch}

    results = in_threads({i: (lambda i=i: body(i)) for i in range(TRAINERS)}, timeout=900)
    for thread in servers:
        thread.join(60)
    near = {k + d for k in changes for d in range(WINDOW + 1)}
    away = [t for r in results.values() for k, t in enumerate(r["times"]) if k not in near and k > 5]
    return {
        "change": change,
        "median_step_s": statistics.median(away),
        "longest_step_near_change_s": [
            max(r["times"][k + d] for r in results.values() for d in range(WINDOW + 1)) for k in changes
        ],
        "table_rows": results[0]["rows"],
        "layout_epoch": results[0]["epoch"],
        "changes": asked,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--changes", default="40,80", help="the steps (0-based) after which trainer 0 asks")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3, help="rounds with changes, each beside one without")
    parser.add_argument("--peers", default=str(DEFAULT_PEERS))
    parser.add_argument("--out", help="write the rounds as JSON here")
    args = parser.parse_args(argv)
    jobs = peer_module(args.peers, "jobs")
    changes = [int(s) for s in args.changes.split(",")]
    rounds = []
    for r in range(args.rounds):
        for change in (True, False):  # alternating: the machine's drift hits both alike
            rounds.append(one_round(jobs, args.steps, changes, args.batch, change))
            print(json.dumps(rounds[-1]), flush=True)
    summary = {
        key: {
            "median_step_s": statistics.median(x["median_step_s"] for x in rounds if x["change"] is key),
            "longest_step_near_change_s": [
                statistics.median(x["longest_step_near_change_s"][j] for x in rounds if x["change"] is key)
                for j in range(len(changes))
            ],
        }
        for key in (True, False)
    }
    print(
        json.dumps({"summary (medians of rounds)": {"with changes": summary[True], "none": summary[False]}})
    )
    if args.out:
        Path(args.out).write_text(json.dumps({"rounds": rounds, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
