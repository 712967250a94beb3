"""Job S of the peer comparison (the CTR job of ``shared/peers/jobs.py``) on this product.

One script, every role, as ``examples/train_ctr.py``; from the repository root (the roles import
``benchmarks.*``, so the repository goes on their PYTHONPATH)::

    PYTHONPATH=. ps-launch --server_num 2 --worker_num 2 benchmarks/jobs/job_s.py            # sync
    PYTHONPATH=. ps-launch --server_num 2 --worker_num 2 benchmarks/jobs/job_s.py --async    # async
    # GEO, a slow trainer:
    PYTHONPATH=. ps-launch --server_num 2 --worker_num 4 benchmarks/jobs/job_s.py --async --k_steps 4 \
        --slow_trainer 3 --slow_ms 40

(``ps-launch`` is ``python -m trainer.launch``; each role's output goes to
``log/serverlog.N`` / ``log/workerlog.N``.) ``python -m benchmarks.bench_peers`` runs it
next to the peers and reads the ``RESULT`` lines from the worker logs.

The job, exactly as ``jobs.py`` defines it: 26 slots of Zipf(1.2) ids
``slot << 40 | z`` looked up in ONE shared dim-16 distributed table (any int64
id; SGD lr 0.05, rows initialised N(0, 0.01^2)), concatenated with 13 dense
features into an MLP 429-256-128-1 (SGD lr 0.05), BCE loss, batch 512 per
trainer, 20 warm-up + 200 timed steps; trainer ``r`` at step ``t`` trains on
``jobs.ctr_batch(t * K + r, batch=512)`` (``K`` trainers). The transpiler runs
with the default :class:`DistributeTranspilerConfig` (what we benchmark); only
``sync_mode`` follows ``--async`` (and ``k_steps``, GEO mode, ``--k_steps``; ``backup_trainers``,
``--backup_trainers``). One torch thread per role.
``--slow_trainer T --slow_ms MS``: trainer T sleeps MS after each step (a straggler: a busier host).

Each trainer uses the fast path a user would: ``tr.batches(loader, 1,
prefetch=lambda b: {"emb": ids})``, so the next batch's ids ride with each
step's push and its rows come back with the answer (one round trip per pserver
per step). All batches are generated before training (data generation is not
timed, as in the peers' ``local-ctr``), and a trainer starts its steps once
every trainer has registered with the pservers (their Stats call), so no
trainer trains while another still generates its data.

Each trainer prints one line ``RESULT {json}``: ``examples`` and the wall-clock
``start``/``end`` (``time.time()``) of its timed steps, and per timed step:
``calls_per_step`` (calls this trainer made to pservers: push+pull, pull and
prefetch, counted by wrapping its pserver channels' methods in this script),
``bytes_pushed_per_step`` / ``bytes_pulled_per_step`` (the channels'
counters, plus the ids of any separate prefetch call), and the split of a step
into forward (``forward_ms``, of which the table's lookups ``lookup_ms``),
backward (``backward_ms``) and ``tr.step()`` (``step_ms``). Trainer 0 also evaluates the hold-out
AUC on ``jobs.ctr_eval_set(20000)`` (``auc``); in async and GEO mode it first waits
until every pserver has received every trainer's last push, and pulls. (In sync mode, with backup
trainers too, it evaluates at once: a live trainer that no longer steps would hold the others' steps.)
It also reports the pservers' own counters (``ps_stats``, from their Stats call). Each pserver prints
``PSERVER_PHASES {json}`` as it exits: its CPU per push over the timed steps,
phase by phase (:class:`benchmarks.jobs.instruments.PserverPhases`; the process's alone with
``PS_BENCH_PHASES=0``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Dict, List, Optional

import numpy as np
import torch
from torch import nn

from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from benchmarks.jobs.instruments import CallCounter, LookupTimer, PserverPhases
from benchmarks.jobs.job_s_program import TABLE, build_program, make_batches
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, RoleEnv

log = logging.getLogger("job_s")


def pserver_stats(endpoints: List[str], timeout: float = 10.0) -> Dict[str, dict]:
    """Each pserver's counters (updates, pushes, prefetches, bytes in/out, table rows) from its Stats call.

    With hot standby (``PS_REPLICA_ENDPOINTS``) each pserver's two processes are asked and the one
    that leads answers for it: the backup has no trainers and counts no pushes.
    """
    import grpc

    from psproto import ps_pb2, ps_pb2_grpc
    from psproto.security import Security

    backups = [b for b in os.environ.get("PS_REPLICA_ENDPOINTS", "").split(",") if b.strip()]
    groups = {ep: [ep, *backups[k : k + 1]] for k, ep in enumerate(endpoints)}
    security = Security.from_env()
    out = {}
    for ep, processes in groups.items():
        out[ep] = {"error": "no process of this pserver leads"}
        for address in processes:
            channel = security.channel(address)
            try:
                r = ps_pb2_grpc.ParameterServerStub(channel).Stats(ps_pb2.StatsRequest(), timeout=timeout)
            except grpc.RpcError as e:
                out[ep] = {"error": str(e.code())}
                continue
            finally:
                channel.close()
            if r.HasField("replica") and r.replica.role != "primary":
                continue
            out[ep] = {
                "updates": r.step,
                "pushes": r.pushes,
                "prefetches": r.prefetches,
                "bytes_in": r.bytes_in,
                "bytes_out": r.bytes_out,
                "table_rows": r.table_rows,
                "disk_rows": sum(t.disk_rows for t in r.tables),
                "trainers_alive": list(r.trainers_alive),
            }
            break
    return out


def wait_for_trainers(endpoints: List[str], trainers: int, timeout: float) -> None:
    """Poll every pserver's Stats until ``trainers`` trainers have registered with each.

    A trainer registers when its Trainer is built, after it generated its
    batches: so no trainer starts its steps while another one still burns CPU
    on data generation (which would slow it and misalign the timed windows).
    Logs a warning (and goes on) if ``timeout`` s pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        stats = pserver_stats(endpoints)
        if all(len(s.get("trainers_alive", ())) >= trainers for s in stats.values()):
            return
        if time.monotonic() > deadline:
            log.warning("not every trainer registered with every pserver within %.0f s: %s", timeout, stats)
            return
        time.sleep(0.05)


def wait_for_pushes(endpoints: List[str], pushes: int, timeout: float) -> Dict[str, dict]:
    """Poll every pserver's Stats until each has received ``pushes`` pushes (async: all trainers done).

    Returns the last stats; logs a warning (and goes on) if ``timeout`` s pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        stats = pserver_stats(endpoints)
        if all(s.get("pushes", 0) >= pushes for s in stats.values()):
            return stats
        if time.monotonic() > deadline:
            log.warning("pservers did not reach %d pushes within %.0f s: %s", pushes, timeout, stats)
            return stats
        time.sleep(0.05)


def evaluate(model: nn.Module, jobs, n: int, seed: int, chunk: int = 4096) -> float:
    """Hold-out AUC of ``model`` on ``jobs.ctr_eval_set(n)`` (lookups ask the pservers)."""
    ids, dense, y = jobs.ctr_eval_set(n, seed=seed, return_logit=False)
    model.eval()
    scores = []
    with torch.no_grad():
        for s in range(0, len(y), chunk):
            scores.append(
                model(torch.from_numpy(ids[s : s + chunk]), torch.from_numpy(dense[s : s + chunk])).numpy()
            )
    model.train()
    return float(jobs.auc(y, np.concatenate(scores).astype(np.float64)))


def train(args, env, jobs, t: DistributeTranspiler) -> dict:
    """Run this trainer's warm-up and timed steps; its RESULT figures (trainer 0: with the AUC)."""
    from trainer import Trainer

    total = args.warmup + args.steps
    t0 = time.perf_counter()
    batches = make_batches(jobs, env.trainer_id, env.trainers, total, args.batch, args.seed)
    gen_s = time.perf_counter() - t0
    loss_fn = nn.BCEWithLogitsLoss()
    compute = step_time = forward = 0.0
    # CPU (not wall) over the timed steps: the whole process, and the main thread's in forward + backward.
    process_cpu = fwd_bwd_cpu = 0.0
    losses: List[float] = []
    start = end = None
    before: Optional[Dict[str, int]] = None
    with Trainer(t.get_trainer_program()) as tr:
        wait_for_trainers(env.pservers, env.trainers, args.eval_wait)
        counter = CallCounter(tr.channels, tr.program.pservers)
        lookup = LookupTimer(tr.model.emb)
        # The plain loop reads the batches itself: each forward's lookup fetches its rows (a round trip).
        items = batches if args.plain else tr.batches(batches, 1, prefetch=lambda b: {TABLE: b[0]})
        for i, (ids, dense, y) in enumerate(items):
            if i == args.warmup:
                before = counter.snapshot()
                start = time.time()
                compute = step_time = forward = 0.0
                lookup.seconds = 0.0
                process_cpu = -time.process_time()
                fwd_bwd_cpu = 0.0
            c0, t0 = time.perf_counter(), time.thread_time()
            loss = loss_fn(tr.model(ids, dense), y)
            cf = time.perf_counter()
            loss.backward()
            c1 = time.perf_counter()
            fwd_bwd_cpu += time.thread_time() - t0
            tr.step()
            c2 = time.perf_counter()
            if env.trainer_id == args.slow_trainer:
                time.sleep(args.slow_ms / 1e3)
            compute += c1 - c0
            forward += cf - c0
            step_time += c2 - c1
            losses.append(loss.item())
            if i == total - 1:
                end = time.time()
                process_cpu += time.process_time()
                after = counter.snapshot()
        steps = args.steps
        result = {
            "role": f"trainer {env.trainer_id}",
            "trainer_id": env.trainer_id,
            "trainers": env.trainers,
            "pservers": len(env.pservers),
            "mode": mode_name(args),
            "slow_ms": args.slow_ms if env.trainer_id == args.slow_trainer else 0.0,
            "batch": args.batch,
            "warmup": args.warmup,
            "steps": steps,
            "examples": steps * args.batch,
            "start": start,
            "end": end,
            "examples_per_s": steps * args.batch / (end - start),
            "calls_per_step": (after["calls"] - before["calls"]) / steps,
            "push_pull_per_step": (after["push_pull_calls"] - before["push_pull_calls"]) / steps,
            "pull_per_step": (after["pull_calls"] - before["pull_calls"]) / steps,
            "prefetch_per_step": (after["prefetch_calls"] - before["prefetch_calls"]) / steps,
            "bytes_pushed_per_step": (after["bytes_pushed"] - before["bytes_pushed"]) / steps,
            "bytes_pulled_per_step": (after["bytes_pulled"] - before["bytes_pulled"]) / steps,
            "compute_ms": 1e3 * compute / steps,
            "step_ms": 1e3 * step_time / steps,
            "forward_ms": 1e3 * forward / steps,
            "backward_ms": 1e3 * (compute - forward) / steps,
            "lookup_ms": 1e3 * lookup.seconds / steps,
            "cpu_ms": 1e3 * process_cpu / steps,
            "fwd_bwd_cpu_ms": 1e3 * fwd_bwd_cpu / steps,
            "loss_first20": float(np.mean(losses[:20])),
            "loss_last20": float(np.mean(losses[-20:])),
            "datagen_s_excluded": round(gen_s, 2),
            "torch_threads": torch.get_num_threads(),
            "loop": "plain" if args.plain else "batches(prefetch=)",
        }
        if env.trainer_id == 0:
            if not args.sync_mode:  # the other trainers may still be pushing: wait for their last step
                tr.pull()  # GEO: this trainer's own last steps first
                per_trainer = -(-total // args.k_steps) if args.k_steps else total  # GEO: one push per window
                wait_for_pushes(env.pservers, env.trainers * per_trainer, args.eval_wait)
                tr.pull()
            e0 = time.perf_counter()
            result["auc"] = evaluate(tr.model, jobs, args.eval_examples, args.seed)
            result["eval_s"] = time.perf_counter() - e0
            result["ps_stats"] = pserver_stats(env.pservers)
            log.info("trainer 0: hold-out AUC %.4f (%d examples)", result["auc"], args.eval_examples)
    log.info(
        "%s: %d timed examples in %.2f s: %.0f examples/s",
        result["role"],
        result["examples"],
        end - start,
        result["examples_per_s"],
    )
    return result


def mode_name(args) -> str:
    """sync, sync-bB (backup trainers), async, or geo-K."""
    if args.k_steps:
        return f"geo-{args.k_steps}"
    return (
        (f"sync-b{args.backup_trainers}" if args.backup_trainers else "sync") if args.sync_mode else "async"
    )


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--async", dest="sync_mode", action="store_false", help="asynchronous updates")
    p.add_argument("--k_steps", type=int, default=0, help="GEO mode, with --async: sync every K steps")
    p.add_argument(
        "--backup_trainers", type=int, default=0, help="sync: steps made by the first trainers - B"
    )
    p.add_argument(
        "--slow_trainer", type=int, default=-1, help="this trainer sleeps --slow_ms after each step"
    )
    p.add_argument("--slow_ms", type=float, default=0.0, help="the slow trainer's delay per step (ms)")
    p.add_argument(
        "--peers", default=DEFAULT_PEERS, help="folder of the peers' jobs.py (default: %(default)s)"
    )
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (default: jobs.S_WARMUP, 20)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: jobs.S_STEPS, 200)")
    p.add_argument("--batch", type=int, default=512, help="per trainer (default %(default)s)")
    p.add_argument(
        "--eval_examples", type=int, default=None, help="hold-out size (default: jobs.S_EVAL_N, 20000)"
    )
    p.add_argument(
        "--eval_wait",
        type=float,
        default=120.0,
        help="at most this many s a trainer waits for the others to register before its first "
        "step, and (async) trainer 0 for the other trainers' last pushes before evaluating",
    )
    p.add_argument("--seed", type=int, default=0, help="data seed of jobs.py")
    p.add_argument(
        "--plain",
        action="store_true",
        help="the plain loop: `for batch in batches: ... tr.step()`, no tr.batches(prefetch=)",
    )
    p.add_argument(
        "--ram_rows",
        type=int,
        default=0,
        help="the table's RAM budget in rows (TableLifecycle.ram_rows); the rest goes to its disk tier",
    )
    p.add_argument("--table_disk_dir", default=None, help="DistributeTranspilerConfig.table_disk_dir")
    p.add_argument(
        "--grad_wire_dtype",
        choices=["bfloat16", "float16"],
        default=None,
        help="push gradients in this dtype (DistributeTranspilerConfig.grad_wire_dtype; "
        "default: as computed)",
    )
    p.add_argument(
        "--no_shared_memory",
        dest="shared_memory",
        action="store_false",
        help="every byte through gRPC (DistributeTranspilerConfig.shared_memory=False): hosts emulated "
        "by network namespaces share /dev/shm, real ones do not",
    )
    args = p.parse_args(argv)
    if (
        (args.warmup is not None and args.warmup < 0)
        or (args.steps is not None and args.steps < 1)
        or args.batch < 1
    ):
        p.error("--warmup must be >= 0, --steps and --batch >= 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    env = RoleEnv.from_env()
    if env is None:
        print(
            "job_s.py runs as a role of a job: PYTHONPATH=. ps-launch --server_num 2 --worker_num 2 "
            "benchmarks/jobs/job_s.py [--async] (the single-process peer is torch_peers.py local-ctr)",
            file=sys.stderr,
        )
        return 2
    jobs = peer_module(args.peers, "jobs")
    args.warmup = jobs.S_WARMUP if args.warmup is None else args.warmup
    args.steps = jobs.S_STEPS if args.steps is None else args.steps
    args.eval_examples = jobs.S_EVAL_N if args.eval_examples is None else args.eval_examples
    torch.set_num_threads(1)  # several roles share this machine's cores
    t = DistributeTranspiler(
        DistributeTranspilerConfig(
            grad_wire_dtype=args.grad_wire_dtype,
            table_disk_dir=args.table_disk_dir,
            shared_memory=args.shared_memory,
            k_steps=args.k_steps,
            backup_trainers=args.backup_trainers,
        )
    )
    t.transpile(
        env.trainer_id,
        program=build_program(jobs, args.seed, args.ram_rows),
        pservers=env.pserver_list,
        trainers=env.trainers,
        sync_mode=args.sync_mode,
    )
    if env.is_pserver:
        from pserver import ParameterServer

        ps_program = t.get_pserver_program(env.current_endpoint)
        server = ParameterServer(ps_program, t.get_startup_program(env.current_endpoint, ps_program))
        phases = PserverPhases(
            server,
            env.trainers * args.warmup,
            env.trainers * (args.warmup + args.steps),
            timed=os.environ.get("PS_BENCH_PHASES", "1") != "0",  # step_breakdown --no-phases
        )
        server.serve()
        print("PSERVER_PHASES " + json.dumps(phases.summary()), flush=True)
        return 0
    result = train(args, env, jobs, t)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
