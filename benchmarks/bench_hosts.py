"""Job S across hosts: this project (async, sync) and TorchRec, on network namespaces joined by a bridge.

Usage (root: it creates network namespaces)::

    python -m benchmarks.bench_hosts [--layouts split,colocated] [--links unshaped,10gbit]
                                     [--systems torchrec,ours-async,ours-sync,paddle-async] [--rounds 3]
                                     [--json FILE]

Job S is the peers' (``../shared/peers/jobs.py``): 26 slots of 1M ids x 16, MLP 429-256-128-1,
global batch 1,024 (split over the trainers), 20 warm-up + 200 timed steps, AUC on 2,000
held-out examples. Every host is a network namespace of ``harness/netns.py`` on one bridge, with
its own address; what crosses between hosts is real TCP through veths, counted at every host's
interface. Roles are placed by a layout (``harness/host_layouts.py``):

- ``split``: pservers on hosts 1-2, trainers on hosts 3-4. TorchRec's two ranks run on the
  trainer hosts (it has no pservers; hosts 1-2 idle).
- ``colocated``: four hosts, each one pserver and one trainer (batch 256 each); TorchRec runs
  four ranks, one per host (batch 256 each).

This project runs as users would run it on real machines: ``ps-launch --servers ... --workers
... --host IP`` on every host (``benchmarks/jobs/job_s.py``), with ``--no_shared_memory`` (the
namespaces share /dev/shm, real hosts do not: every byte goes through gRPC and TCP). TorchRec
runs ``torchrec_ctr.py``'s own worker per rank (``jobs/torchrec_rank.py``, gloo over TCP,
``GLOO_SOCKET_IFNAME`` the host's interface), in its venv (``shared/peers/setup_torchrec.sh``).

PaddlePaddle 2.6.2's parameter server (``--systems ...,paddle-async,paddle-sync``, where its venv
exists: ``shared/peers/setup_paddle.sh``) runs ``paddle_ps_ctr.py``'s own role processes, pservers
and trainers on the same hosts as this project's, with Paddle's role variables carrying the hosts'
addresses (``--data jobs``: job S's data; Paddle sums sparse gradients over the batch and clips
rows, so its AUC is not comparable one to one).

Links (``--links``): ``unshaped`` (veths as fast as the CPU moves them) or a rate (``10gbit``,
``1gbit``) given to every host's link each way (``netns.Hosts``). A delay needs the kernel's
netem, which this machine's kernel lacks: ``--delay`` is passed on where it exists.

Rounds alternate the systems (the order rotates each round). Per layout and link: examples/s
median [min-max], the ratio to TorchRec round by round, AUC, and bytes on the wire per trained
example (every host's transmitted bytes over the whole run, start and evaluation included, over
the warm-up and timed examples), and the machine's other load. Output: a Markdown table and
every run in ``--json`` (default ``benchmarks/results/hosts-<today>.json``).
``python -m harness.netns cleanup`` removes namespaces left by a SIGKILLed run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from typing import Dict, List, Optional, Tuple

from benchmarks.common.machine import OtherLoad
from benchmarks.common.paths import DEFAULT_PEERS, REPO, dated_result, job_script, peer_module
from benchmarks.common.peer_runners import role_result, venv_problem
from harness.host_layouts import HostLayout, parse_layout, per_host_commands
from harness.netns import IFNAME, Hosts, NetnsError, host_env
from harness.processes import Command, RunFailed, stop_on_signals

SYSTEMS = ("torchrec", "ours-async", "ours-sync", "paddle-async", "paddle-sync")
GLOBAL_BATCH = 1024
PS_PORT, GLOO_PORT, PADDLE_PORT = 6200, 29600, 36000
DEFAULT_PADDLE_PYTHON = os.path.join(tempfile.gettempdir(), "paddle26-venv", "bin", "python")

log = logging.getLogger("bench_hosts")


def run_in_hosts(hosts: Hosts, commands: Dict[str, Tuple[int, List[str], str]], timeout: float) -> None:
    """Run ``{what: (host, argv, log)}`` at once, each in its host, to completion within one deadline.

    RunFailed names the first that failed or ran past it; every command and what it started is
    stopped on the way out, whatever happened.
    """
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as running:
        started = {
            what: running.enter_context(
                Command(hosts.cmd(host, *argv), log, env=host_env(GLOO_SOCKET_IFNAME=IFNAME), cwd=REPO)
            )
            for what, (host, argv, log) in commands.items()
        }
        for what, c in started.items():
            rc = c.wait(max(0.0, deadline - time.monotonic()), what)
            if rc != 0:
                raise RunFailed(f"{what} exited with status {rc}; log {c.log_path}")


def run_ours(hosts: Hosts, layout: HostLayout, sync: bool, args, workdir: str, index: int) -> dict:
    """Job S on this project: ps-launch per host, as on real machines; throughput and AUC from its
    trainers."""
    batch = GLOBAL_BATCH // len(layout.trainers)
    script = [
        job_script("job_s"),
        "--peers",
        args.peers,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--batch",
        str(batch),
        "--eval_examples",
        str(args.eval),
        "--no_shared_memory",
        *([] if sync else ["--async"]),
    ]
    cmds = per_host_commands(
        layout, hosts.ip, PS_PORT + 10 * index, lambda h: os.path.join(workdir, f"host{h}"), script
    )
    run_in_hosts(
        hosts,
        {
            f"ps-launch on host {h}": (h, cmd, os.path.join(workdir, f"launch{h}.log"))
            for h, cmd in cmds.items()
        },
        args.timeout,
    )
    res = [
        role_result(os.path.join(workdir, f"host{h}", f"workerlog.{j}"))
        for j, h in enumerate(layout.trainers)
    ]
    span = max(r["end"] for r in res) - min(r["start"] for r in res)
    return {"examples_s": sum(r["examples"] for r in res) / span, "auc": res[0].get("auc"), "batch": batch}


def run_torchrec(hosts: Hosts, layout: HostLayout, args, workdir: str, index: int) -> dict:
    """Job S on TorchRec: one rank per trainer host, gloo over TCP between them; rank 0's result."""
    world = len(layout.trainers)
    batch = GLOBAL_BATCH // world
    out = os.path.join(workdir, "torchrec.json")
    ranks = {}
    for rank, h in enumerate(layout.trainers):
        cmd = [
            args.torchrec_python,
            os.path.join(REPO, "benchmarks", "jobs", "torchrec_rank.py"),
            "--peers",
            args.peers,
            "--rank",
            str(rank),
            "--world",
            str(world),
            "--master",
            hosts.ip(layout.trainers[0]),
            "--port",
            str(GLOO_PORT + index),
            "--out",
            out,
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--batch",
            str(batch),
        ]
        ranks[f"TorchRec rank {rank} on host {h}"] = (h, cmd, os.path.join(workdir, f"rank{rank}.log"))
    run_in_hosts(hosts, ranks, args.timeout)
    with open(out) as f:
        r = json.load(f)
    return {"examples_s": r["examples_per_s"], "auc": r["auc"], "batch": batch, "plan": r.get("plan")}


def run_paddle(hosts: Hosts, layout: HostLayout, sync: bool, args, workdir: str, index: int) -> dict:
    """Job S on PaddlePaddle 2.6's PS: ``paddle_ps_ctr.py``'s own role process per pserver and trainer,
    each on its host (Paddle's role variables, with the hosts' addresses); throughput over its trainers,
    trainer 0's AUC.

    Its pservers never leave ``run_server()`` (fleetrun kills them too): they are stopped once the trainers
    ended. A sync pserver runs SCHED_RR (``chrt``), as ``bench_peers`` runs it: Paddle 2.6's sync barrier
    loses a wake-up under normal scheduling.
    """
    batch = GLOBAL_BATCH // len(layout.trainers)
    base = PADDLE_PORT + 20 * index
    gloo = os.path.join(workdir, "gloo_fs")
    os.makedirs(gloo, exist_ok=True)
    env = {
        "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(
            f"{hosts.ip(h)}:{base + i}" for i, h in enumerate(layout.pservers)
        ),
        "PADDLE_TRAINER_ENDPOINTS": ",".join(
            f"{hosts.ip(h)}:{base + 10 + t}" for t, h in enumerate(layout.trainers)
        ),
        "PADDLE_TRAINERS_NUM": str(len(layout.trainers)),
        "PADDLE_WITH_GLOO": "1",
        "PADDLE_GLOO_RENDEZVOUS": "2",
        "PADDLE_GLOO_FS_PATH": gloo,
        "FLAGS_enable_pir_api": "0",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "CPU_NUM": "1",
        "GLOO_SOCKET_IFNAME": IFNAME,
    }
    argv = [
        args.paddle_python,
        os.path.join(args.peers, "paddle_ps_ctr.py"),
        "--role-proc",
        "--mode",
        "sync" if sync else "async",
        "--data",
        "jobs",
        "--seed",
        "0",
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch",
        str(batch),
        "--eval-examples",
        str(args.eval),
        "--result-dir",
        workdir,
    ]
    rt = ["chrt", "-r", "10"] if sync else []

    def role(h: int, name: str, **extra: str) -> Command:
        # Paddle's gloo (its trainers' barriers) publishes the address its host name resolves to: each role
        # gets a UTS namespace whose host name is its host's address.
        named = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hosts.ip(h)]
        return Command(
            hosts.cmd(h, *named, *(rt if extra["TRAINING_ROLE"] == "PSERVER" else []), *argv),
            os.path.join(workdir, f"{name}.log"),
            env=host_env(**env, POD_IP=hosts.ip(h), **extra),
            cwd=workdir,
        )

    deadline = time.monotonic() + args.timeout
    with contextlib.ExitStack() as running:
        for i, h in enumerate(layout.pservers):
            running.enter_context(role(h, f"pserver{i}", TRAINING_ROLE="PSERVER", PADDLE_PORT=str(base + i)))
        trainers = [
            running.enter_context(
                role(
                    h,
                    f"trainer{t}",
                    TRAINING_ROLE="TRAINER",
                    PADDLE_TRAINER_ID=str(t),
                    PADDLE_PORT=str(base + 10 + t),
                )
            )
            for t, h in enumerate(layout.trainers)
        ]
        for t, c in enumerate(trainers):
            rc = c.wait(max(0.0, deadline - time.monotonic()), f"Paddle trainer {t}")
            if rc != 0:
                raise RunFailed(f"Paddle trainer {t} exited with status {rc}; log {c.log_path}")
    res = []
    for t in range(len(layout.trainers)):
        with open(os.path.join(workdir, f"trainer{t}.json")) as f:
            res.append(json.load(f))
    span = max(r["t_end"] for r in res) - min(r["t_start"] for r in res)
    return {
        "examples_s": sum(r["measured_steps"] * r["batch"] for r in res) / span,
        "auc": res[0].get("holdout_auc"),
        "batch": batch,
    }


def run_one(system: str, hosts: Hosts, layout: HostLayout, link: str, rnd: int, index: int, args) -> dict:
    """One run of ``system`` on ``layout``: its figures, the bytes every host sent, the other load."""
    workdir = os.path.join(args.work, f"{link}-{layout.name.replace(':', '_')}-{rnd}-{system}")
    os.makedirs(workdir, exist_ok=True)
    before = {h: hosts.counters(h) for h in hosts.numbers()}
    with OtherLoad() as load:
        if system == "torchrec":
            row = run_torchrec(hosts, layout, args, workdir, index)
        elif system.startswith("paddle"):
            row = run_paddle(hosts, layout, system == "paddle-sync", args, workdir, index)
        else:
            row = run_ours(hosts, layout, system == "ours-sync", args, workdir, index)
    sent = sum(hosts.moved(before[h], hosts.counters(h))["tx_bytes"] for h in hosts.numbers())
    trained = (args.warmup + args.steps) * GLOBAL_BATCH
    row.update(
        system=system,
        layout=layout.name,
        link=link,
        round=rnd,
        wire_bytes=sent,
        wire_bytes_per_example=sent / trained,
        other_load=load.cores,
        wall_s=load.wall,
    )
    log.info(
        "%s, %s, %s, round %d: %.0f examples/s, AUC %s, %.0f bytes on the wire per example, other load %.2f",
        link,
        layout.name,
        system,
        rnd,
        row["examples_s"],
        row["auc"],
        row["wire_bytes_per_example"],
        load.cores,
    )
    return row


def table(rows: List[dict]) -> str:
    """Markdown: per link and layout, each system's median [min-max], its ratio to TorchRec per round, AUC,
    bytes."""
    out = [
        "| link | layout | system | examples/s median [min-max] | vs TorchRec, round by round | AUC | "
        "wire bytes / example | other load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for link, layout in dict.fromkeys((r["link"], r["layout"]) for r in rows):  # in the order they ran
        mine = [r for r in rows if (r["link"], r["layout"]) == (link, layout)]
        ref = {r["round"]: r["examples_s"] for r in mine if r["system"] == "torchrec"}
        for system in dict.fromkeys(r["system"] for r in mine):
            runs = sorted((r for r in mine if r["system"] == system), key=lambda r: r["round"])
            xs = [r["examples_s"] for r in runs]
            ratios = [r["examples_s"] / ref[r["round"]] for r in runs if r["round"] in ref]
            vs = "-"
            if ratios:
                vs = ", ".join(f"{x:.2f}" for x in ratios) + f": **{statistics.median(ratios):.2f}x**"
            out.append(
                f"| {link} | {layout} | {system} | "
                f"{statistics.median(xs):,.0f} [{min(xs):,.0f}-{max(xs):,.0f}] | {vs} | "
                f"{statistics.median(r['auc'] for r in runs):.3f} | "
                f"{statistics.median(r['wire_bytes_per_example'] for r in runs):,.0f} | "
                f"{max(r['other_load'] for r in runs):.2f} |"
            )
    return "\n".join(out)


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--layouts",
        default="split,colocated",
        help="comma-separated (harness/host_layouts.py; default %(default)s)",
    )
    p.add_argument(
        "--links",
        default="unshaped,10gbit",
        help="comma-separated: unshaped, or a rate per host link such as 10gbit (default %(default)s)",
    )
    p.add_argument("--delay", default=None, help="one-way delay per link (needs the kernel's netem)")
    p.add_argument(
        "--systems",
        default="torchrec,ours-async,ours-sync",
        help=f"comma-separated, of {','.join(SYSTEMS)} (default %(default)s)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200, help="timed steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument(
        "--eval", type=int, default=2000, help="held-out examples for the AUC (default %(default)s)"
    )
    p.add_argument("--peers", default=DEFAULT_PEERS)
    p.add_argument(
        "--torchrec-python", default=os.path.join(tempfile.gettempdir(), "torchrec-venv", "bin", "python")
    )
    p.add_argument(
        "--paddle-python",
        default=DEFAULT_PADDLE_PYTHON,
        help="PaddlePaddle 2.6.2's venv (shared/peers/setup_paddle.sh; default %(default)s)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="per run, s")
    p.add_argument("--work", default=None, help="logs of every run (default: a temporary folder)")
    p.add_argument("--json", default=dated_result("hosts"), help="every run (default %(default)s)")
    args = p.parse_args(argv)
    try:
        args.layouts = [parse_layout(x) for x in args.layouts.split(",")]
    except ValueError as e:
        p.error(str(e))
    args.links = args.links.split(",")
    args.systems = args.systems.split(",")
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown or args.rounds < 1 or args.steps < 1 or args.warmup < 0:
        p.error(f"systems of {SYSTEMS} (got {unknown or 'ok'}); --rounds, --steps >= 1, --warmup >= 0")
    if any(GLOBAL_BATCH % len(lay.trainers) for lay in args.layouts):
        p.error(f"every layout's trainers must divide the global batch of {GLOBAL_BATCH}")
    if "torchrec" in args.systems:
        problem = venv_problem(args.torchrec_python, "torchrec", "setup_torchrec.sh")
        if problem:
            p.error(problem)
    if any(s.startswith("paddle") for s in args.systems):
        problem = venv_problem(args.paddle_python, "paddle", "setup_paddle.sh")
        if problem:
            p.error(problem)
    peer_module(args.peers, "jobs")  # fails early, naming the folder, when the peers are not there
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if os.geteuid() != 0:
        log.error("network namespaces need root")
        return 2
    stop_on_signals()  # so the `with` blocks stop the children and remove the namespaces
    args.work = args.work or tempfile.mkdtemp(prefix="bench_hosts-")
    rows: List[dict] = []
    index = 0
    try:
        for link in args.links:
            rate = None if link == "unshaped" else link
            with Hosts(max(lay.hosts for lay in args.layouts), rate=rate, delay=args.delay) as hosts:
                for layout in args.layouts:
                    for rnd in range(args.rounds):
                        k = rnd % len(args.systems)
                        for system in args.systems[k:] + args.systems[:k]:
                            rows.append(run_one(system, hosts, layout, link, rnd, index, args))
                            index += 1
    except (RunFailed, NetnsError) as e:
        log.error("%s (logs in %s)", e, args.work)
        return 1
    finally:
        if rows:
            with open(args.json, "w") as f:
                json.dump({"argv": sys.argv[1:], "runs": rows}, f, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
