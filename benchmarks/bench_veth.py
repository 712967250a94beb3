"""Job D across network namespaces ("hosts" on a bridge, real TCP), and on loopback, side by side.

Usage (root: it creates network namespaces)::

    python -m benchmarks.bench_veth [--rounds 3] [--configs ps-veth,rpc-veth,...] [--steps 30]
                                    [--warmup 5] [--layout pair|split|colocated:2] [--rate 10gbit]
                                    [--delay 0.1ms] [--json FILE]

Job D is the peers' (``../shared/peers/jobs.py``): MLP 512-2048-2048-2048-10
(37.9 MB fp32), SGD lr 0.01, 2 trainers of batch 256, 5 warm-up + 30 timed
steps, every trainer on ``jobs.dense_batch(step, rank)``, and the same initial
weights everywhere (so the losses of all configurations agree). Each role is
its own OS process started with ``ip netns exec``; ``harness/netns.py`` makes the
namespaces ("host 1" at 10.231.N.1, "host 2" at 10.231.N.2, ...) once for the whole
run and removes them at the end, also on errors, Ctrl-C and SIGTERM.

``--layout`` places the roles of the ``*-veth`` configurations (``harness/host_layouts.py``):
``pair`` (the default, as described below: pservers in host 1, trainers in host 2), ``split``
(pserver i in host i, trainer j in host 3 + j; DDP's ranks and the rpc PS's trainers on the
trainer hosts) or ``colocated:2`` (pserver i and trainer i in host i + 1: half of each trainer's
blocks stay on its host). The ``*-lo`` configurations always run in host 1.

Configurations (``--configs``, default all, in this order):

- ``ps-veth``: this product, sync, 2 pservers in host 1 (each bound to
  10.231.N.1:PORT) x 2 trainers in host 2 (``jobs/dense_workers.py``'s roles via
  ``jobs/veth_workers.py``): every push and pull crosses the veth. Shared memory
  off (``shared_memory=False``), as between two real hosts.
- ``ps-veth-shm``: as ``ps-veth`` with the default ``shared_memory=True``:
  the namespaces share one host and PID namespace, so the pservers map the
  trainers' regions and only gRPC's control messages cross the veth (the
  same-host shortcut, as ``rpc-veth-cma``).
- ``ps-veth-bf16``: as ``ps-veth``, gradients pushed in bfloat16
  (``grad_wire_dtype``): a quarter fewer bytes per step cross the veth.
- ``ps-veth-lanes2``, ``ps-veth-lanes4``: as ``ps-veth``, each push-pull split across 2 or 4
  connections per pserver (``push_lanes``).
- ``rpc-veth``: the ``torch.distributed.rpc`` batch-updating parameter server of
  ``torch_peers.py rpc-ps-dense --ps 2`` (its classes and trainer loop,
  imported), ranks ps0, ps1 in host 1 and the 2 trainers in host 2; rendezvous
  over TCP at host 1; TensorPipe restricted to what it can use between two
  real hosts: transport ``uv`` (TCP) and channels ``mpt_uv,basic``
  (``--tp-channels``), bound to the veth (``TP_SOCKET_IFNAME``).
- ``ddp-veth``: DDP over gloo, rank 0 in host 1, rank 1 in host 2
  (``GLOO_SOCKET_IFNAME`` = the veth).
- ``rpc-veth-cma``: as ``rpc-veth`` but with TensorPipe's defaults. Its ``shm``
  transport needs one network namespace, so TCP carries the messages, but its
  ``cma`` channel only needs one host (same boot id and PID namespace) and
  copies the tensors with ``process_vm_readv``: they never cross the veth.
  The same-host shortcut, shown by the veth counters.
- ``ps-lo``, ``ddp-lo``: the same jobs with every process in host 1 on 127.0.0.1
  (``ps-lo``: the defaults, so shared memory).
- ``ps-lo-grpc``: as ``ps-lo`` with shared memory off: every byte through gRPC on loopback.
- ``rpc-lo``: the torch peer on one host with TensorPipe's defaults (``shm``
  transport + ``cma`` channel), as ``torch_peers.py`` measures it.
- ``rpc-lo-tcp``: the torch peer on 127.0.0.1 restricted to TCP as ``rpc-veth``.

Rounds alternate the configurations (the order rotates each round). Per
configuration, medians [min-max] over rounds: samples/s (all trainers'
samples / the slowest trainer's timed wall time), ratios against DDP and the
torch RPC PS on the same link (per-round ratios), MB between the hosts per
step (what every host's interface sent over the whole run, start included,
over the warm-up and timed steps), that as a share of the payload the layout
must move between hosts (PS: 2 trainers x (gradients + parameters) times the
share of trainer-pserver pairs on different hosts; DDP, one rank per host:
2 x the model, ring all-reduce of 2 ranks), and the machine's other load (CPU cores busy with
anything else, from /proc/stat). A check that the traffic did cross the veth
(>= 90% of the payload for ``*-veth`` over TCP) and did not for ``*-lo``
fails the run (exit 1) if not met. ``--rate`` / ``--delay`` shape both veth
ends (tc netem; a rate alone falls back to tbf where netem is missing), off
by default: the veth alone is a fast virtual link with no delay.

Output: a markdown table on stdout and every run's figures in ``--json``
(default ``benchmarks/results/veth-<today>.json``). Worker logs go to a temp directory, kept on
failure (or to ``--logdir``). ``python -m harness.netns cleanup`` removes
namespaces left by a SIGKILLed run. The configurations, the veth check and the table are
``reports/veth.py``'s, the roles and their runs ``common/veth_runs.py``'s; this module runs the rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import List, Optional

from benchmarks.common.machine import OtherLoad
from benchmarks.common.paths import DEFAULT_PEERS, dated_result, peer_module
from benchmarks.common.veth_runs import (
    PSERVERS,
    TRAINERS,
    ConnectionSampler,
    NsProcesses,
    run_ddp,
    run_ps,
    run_rpc,
)
from benchmarks.jobs.dense_workers import Spec, param_bytes
from benchmarks.reports.dense import summarize
from benchmarks.reports.veth import CONFIGS, CROSSED_MIN, LOOPBACK_MAX, crossing_problems, table
from harness.host_layouts import HostLayout, parse_layout
from harness.netns import Hosts, NetnsError
from harness.processes import RunFailed, stop_on_signals

log = logging.getLogger("bench_veth")


# -- figures ---------------------------------------------------------------------


def payload_per_step(system: str, spec: Spec, layout: HostLayout) -> float:
    """Bytes a step must move between the hosts of ``layout``.

    PS (and the rpc PS): each trainer's gradients and parameters, times the share of (trainer,
    pserver) pairs on different hosts (the blocks are dealt evenly); DDP (one rank per host): 2 x the
    model, a ring all-reduce of 2 ranks.
    """
    model = param_bytes(spec.sizes)
    if system in ("ps", "rpc"):
        pairs = [(t, p) for t in layout.trainers for p in layout.pservers]
        remote = sum(t != p for t, p in pairs) / len(pairs)
        return (
            remote * TRAINERS * (1.5 if spec.grad_wire_dtype else 2) * model
        )  # a narrow push is half a float32 one
    return 2 * (TRAINERS - 1) * model


def _veth_per_step(results: List[dict]) -> Optional[float]:
    """Mean over workers of their host's interface bytes (rx + tx) per timed step they counted; None if not
    counted."""
    counted = [
        (r["veth_rx_bytes"] + r["veth_tx_bytes"]) / r["steps"] for r in results if "veth_rx_bytes" in r
    ]
    return sum(counted) / len(counted) if counted else None


def run_one(name: str, rnd: int, index: int, hosts: Hosts, args, workdir: str) -> dict:
    """One run of configuration ``name`` in round ``rnd``: start its processes, wait, and return its
    figures."""
    config = CONFIGS[name]
    ports = [21000 + 10 * (index % 2000) + k for k in range(4)]  # fresh ports each run: no TIME_WAIT reuse
    spec = dataclasses.replace(
        args.spec, grad_wire_dtype=config.wire, shared_memory=config.shared, push_lanes=config.lanes
    )
    with OtherLoad() as load:
        before = {h: hosts.counters(h) for h in hosts.numbers()}
        with ConnectionSampler(hosts, args.layout.trainers[0]) as conns, NsProcesses(workdir, spec) as procs:
            if config.system == "ps":
                workers, servers = run_ps(procs, hosts, config.link, ports, args)
                row = summarize(name, spec, workers, servers)
                row["losses_first_last"] = [
                    sum(w["losses"][i] for w in workers) / len(workers) for i in (0, -1)
                ]
                veth = _veth_per_step(workers)
            elif config.system == "ddp":
                workers = run_ddp(procs, hosts, config.link, ports, args)
                row = summarize(name, spec, workers, [])
                row["losses_first_last"] = [
                    sum(w["losses"][i] for w in workers) / len(workers) for i in (0, -1)
                ]
                veth = _veth_per_step(workers)
            else:
                rec = run_rpc(procs, hosts, config, ports, args)
                row = {
                    "config": name,
                    "samples_s": rec["samples_per_s"],
                    "step_ms": rec["ms_per_step"],
                    "compute_ms": rec["trainer_compute_ms_per_step"],
                    "update_ms": rec["trainer_comm_wait_ms_per_step"],
                    "losses_first_last": [rec["first_loss"], rec["final_loss"]],
                    "rpc": rec,
                }
                veth = _veth_per_step([{**t, "steps": spec.steps} for t in rec["per_trainer"]])
        moved = {h: hosts.moved(before[h], hosts.counters(h)) for h in hosts.numbers()}
    # Every byte between two hosts leaves exactly one host's interface: what they all sent is what crossed.
    sent = sum(m["tx_bytes"] for m in moved.values())
    sent_per_step = sent / (spec.warmup + spec.steps)
    payload = payload_per_step(config.system, spec, args.layout)  # on lo too: what it would have had to move
    row.pop("losses", None)
    row.update(
        {
            "round": rnd,
            "system": config.system,
            "link": config.link,
            "tcp_only": config.tcp_only,
            "wall_s": load.wall,
            "other_load": load.cores,
            "layout": args.layout.name,
            "veth_mb_step": sent_per_step / 1e6,
            "veth_share": sent_per_step / payload if payload else 0.0,
            "veth_mb_run": sent / 1e6,
            "veth_run_bytes": moved,
            "workers_veth_mb_step": (veth or 0.0) / 1e6,
            "veth_tcp_conns_peak": conns.peak,
        }
    )
    return row


# -- driver ----------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--rounds", type=int, default=3, help="rounds; each runs every configuration once (default 3)"
    )
    p.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)} (default: all)",
    )
    p.add_argument("--steps", type=int, default=None, help="timed steps per run (default: jobs.py's, 30)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: jobs.py's, 5)")
    p.add_argument(
        "--layout",
        default="pair",
        help="where the roles run across the veths (harness/host_layouts.py): pair (default: pservers "
        "on host 1, trainers on host 2), split (pservers on hosts 1-2, trainers on 3-4) or "
        "colocated:2 (a pserver and a trainer on each of 2 hosts)",
    )
    p.add_argument("--rate", help="shape each veth end to this rate (tc syntax, e.g. 10gbit); off by default")
    p.add_argument("--delay", help="one-way delay on each veth end (tc netem, e.g. 0.1ms); off by default")
    p.add_argument(
        "--tp-channels",
        dest="tp_channels",
        default="mpt_uv,basic",
        help="TensorPipe channels of the TCP-only torch rpc configurations (default: %(default)s, "
        "what it picks between two real hosts; 'basic' sends tensors over the one uv pipe)",
    )
    p.add_argument(
        "--peers", default=None, help="directory of jobs.py and torch_peers.py (default ../shared/peers)"
    )
    p.add_argument("--timeout", type=float, default=300.0, help="deadline of one run in s (default 300)")
    p.add_argument(
        "--json",
        default=dated_result("veth"),
        help="every run's figures (default %(default)s)",
    )
    p.add_argument("--logdir", help="keep worker logs here (default: a temp dir, kept on failure)")
    args = p.parse_args(argv)
    try:
        args.layout = parse_layout(args.layout)
    except ValueError as e:
        p.error(str(e))
    if (len(args.layout.pservers), len(args.layout.trainers)) != (PSERVERS, TRAINERS):
        p.error(
            f"job D runs {PSERVERS} pservers and {TRAINERS} trainers; layout {args.layout.name} places "
            f"{len(args.layout.pservers)} and {len(args.layout.trainers)} (colocated: use colocated:2)"
        )
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"unknown configurations {unknown}; choose from {', '.join(CONFIGS)}")
    args.peers = os.path.abspath(args.peers or os.environ.get("BENCH_PEERS_DIR") or DEFAULT_PEERS)
    for f in ("jobs.py", "torch_peers.py"):
        if not os.path.exists(os.path.join(args.peers, f)):
            p.error(f"{f} not found in {args.peers} (--peers)")
    jobs = peer_module(args.peers, "jobs")
    args.spec = Spec(
        sizes=tuple(jobs.D_SIZES),
        batch=jobs.D_BATCH_PER_TRAINER,
        lr=jobs.D_LR,
        warmup=jobs.D_WARMUP if args.warmup is None else args.warmup,
        steps=jobs.D_STEPS if args.steps is None else args.steps,
        sync_mode=True,
        timeout=args.timeout,
    )
    if jobs.D_TRAINERS != TRAINERS:
        p.error(f"jobs.py's job D has {jobs.D_TRAINERS} trainers; this benchmark runs {TRAINERS}")
    if args.rounds < 1 or args.spec.steps < 1 or args.spec.warmup < 0 or args.timeout <= 0:
        p.error("--rounds and --steps must be >= 1, --warmup >= 0, --timeout > 0")
    if os.geteuid() != 0:
        p.error("network namespaces need root")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop_on_signals()  # so the `with` blocks stop the children and remove the namespaces
    spec = args.spec
    logdir = args.logdir or tempfile.mkdtemp(prefix="bench_veth-")
    shaping = " ".join(
        filter(None, [args.rate and f"rate {args.rate}", args.delay and f"delay {args.delay}"])
    )
    log.info(
        "job D: MLP %s (%.1f MB fp32), batch %d x %d trainers, lr %g, %d warm-up + %d timed steps; "
        "%d rounds of %s; veth %s",
        "-".join(map(str, spec.sizes)),
        param_bytes(spec.sizes) / 1e6,
        spec.batch,
        TRAINERS,
        spec.lr,
        spec.warmup,
        spec.steps,
        args.rounds,
        ", ".join(args.configs),
        f"shaped ({shaping})" if shaping else "not shaped",
    )
    rows: List[dict] = []
    ok = False
    try:
        with Hosts(args.layout.hosts, rate=args.rate, delay=args.delay) as hosts:
            index = 0
            for rnd in range(args.rounds):
                k = rnd % len(args.configs)
                for name in args.configs[k:] + args.configs[:k]:
                    workdir = os.path.join(logdir, f"{rnd}-{name}")
                    os.makedirs(workdir, exist_ok=True)
                    row = run_one(name, rnd, index, hosts, args, workdir)
                    index += 1
                    rows.append(row)
                    log.info(
                        "round %d %-12s %6.0f samples/s, %6.1f MB/step over the veth (%5.1f%% of the "
                        "payload; "
                        "whole run %.0f MB; at most %d TCP connections across it), other load %.2f cores",
                        rnd,
                        name,
                        row["samples_s"],
                        row["veth_mb_step"],
                        100 * row["veth_share"],
                        row["veth_mb_run"],
                        row["veth_tcp_conns_peak"],
                        row["other_load"],
                    )
        ok = True
    except (RunFailed, NetnsError) as e:
        log.error("FAILED: %s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted; child processes stopped, namespaces removed")
        return 130
    finally:
        if rows and args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "spec": spec.__dict__,
                        "configs": args.configs,
                        "rounds": args.rounds,
                        "shaping": shaping or None,
                        "tp_channels": args.tp_channels,
                        "layout": args.layout.name,
                        "configurations": {c: CONFIGS[c].what for c in args.configs},
                        "runs": rows,
                    },
                    f,
                    indent=1,
                )
        if ok and not args.logdir:
            shutil.rmtree(logdir, ignore_errors=True)
        elif not ok:
            log.error("worker logs kept in %s", logdir)
    print()
    print(
        f"Job D (MLP {'-'.join(map(str, spec.sizes))}, {param_bytes(spec.sizes) / 1e6:.1f} MB, batch "
        f"{spec.batch} x "
        f"{TRAINERS} trainers, {spec.warmup} + {spec.steps} steps), medians [min-max] of {args.rounds} "
        "rounds; "
        f"veth {'shaped: ' + shaping if shaping else 'not shaped'}; the veth configurations' roles placed by "
        "layout "
        f"{args.layout.name} (the host numbers below are pair's):"
    )
    print()
    print(table(rows, args.configs))
    problems = crossing_problems(rows)
    for problem in problems:
        log.error("veth check: %s", problem)
    if not problems:
        log.info(
            "veth check passed: the TCP configurations across the veth moved >= %.0f%% of their payload "
            "through it, the loopback ones <= %.0f%%",
            100 * CROSSED_MIN,
            100 * LOOPBACK_MAX,
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
