"""How each system of ``bench_peers.py`` runs: one function per (job, system), in :data:`RUNNERS`.

Each takes the parsed arguments and a work directory, runs the system once (a peer's script from
``shared/peers``, or this project through ``ps-launch``), and returns its figures:
``examples_s`` (job D: samples/s) and whatever else it measured (AUC, calls and bytes per step,
``detail``). A run that fails raises :class:`~harness.processes.RunFailed` with the log's
tail. This project's jobs run through ps-launch as scripts (``benchmarks/jobs/*.py``), with the
repository on their PYTHONPATH; the peers run as scripts of their own Python (venv).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
from typing import List, Optional, Sequence

from benchmarks.common.dense_runs import run_ps
from benchmarks.common.paths import REPO, job_script, peer_module
from benchmarks.jobs.dense_workers import Spec
from benchmarks.reports.dense import summarize
from harness.paths import pythonpath_with_repo
from harness.processes import RunFailed, last_json_line, run_command, tail

JOB_S_SCRIPT = job_script("job_s")
JOB_D_COLLECTIVE = job_script("job_d_collective")


def run_torch_peer(args, workdir: str, sub: Sequence[str], what: str) -> dict:
    """One ``torch_peers.py`` subcommand (``sub``); its JSON line."""
    cmd = [
        sys.executable,
        os.path.join(args.peers, "torch_peers.py"),
        *sub,
        "--timeout",
        str(max(30.0, args.timeout - 30)),
    ]
    text = run_command(cmd, os.path.join(workdir, "peer.log"), args.timeout, what)
    return last_json_line(text, what)


def run_local_ctr(args, workdir: str) -> dict:
    """Job S in one PyTorch process at the global batch (2 x 512)."""
    r = run_torch_peer(
        args,
        workdir,
        [
            "local-ctr",
            "--batch",
            str(2 * args.s_batch),
            "--warmup",
            str(args.s_warmup),
            "--steps",
            str(args.s_steps),
        ],
        "torch_peers.py local-ctr",
    )
    return {"examples_s": r["examples_per_s"], "auc": r["auc"], "detail": r}


def role_result(path: str, prefix: str = "RESULT ") -> dict:
    """The JSON a role printed after ``prefix`` (its last such line) into its log ``path``; RunFailed if
    none."""
    found = None
    with contextlib.suppress(OSError), open(path, errors="replace") as f:
        for line in f:
            if line.startswith(prefix):
                found = json.loads(line[len(prefix) :])
    if found is None:
        raise RunFailed(f"{os.path.basename(path)} has no {prefix.strip()} line; {path}:\n{tail(path)}")
    return found


def role_results(log_dir: str, log: str, count: int, prefix: str = "RESULT ") -> List[dict]:
    """The JSON each of the first ``count`` roles printed after ``prefix`` into ``log_dir/log.N``
    (:func:`role_result`)."""
    return [role_result(os.path.join(log_dir, f"{log}.{n}"), prefix) for n in range(count)]


def job_s_results(log_dir: str, trainers: int) -> List[dict]:
    """The RESULT objects ps-launch's first ``trainers`` workers printed into ``log_dir/workerlog.N``."""
    return role_results(log_dir, "workerlog", trainers)


def run_ours_s(
    args,
    workdir: str,
    sync: bool,
    pservers: int = 2,
    trainers: int = 2,
    wire: Optional[str] = None,
    plain: bool = False,
    ram_rows: int = 0,
    replicas: int = 1,
    coordinator: Optional[str] = None,
    extra: Sequence[str] = (),
) -> dict:
    """Job S on this project through ps-launch; throughput over all trainers and per-trainer per-step figures.

    ``replicas`` 2: a backup per pserver (``--server_replicas 2 --coordinator COORDINATOR``, hot standby).
    ``extra``: more ``job_s.py`` arguments (``--k_steps 4``, ``--slow_trainer 3 --slow_ms 40``).
    """
    log_dir = os.path.join(workdir, "log")
    hot_standby = ["--server_replicas", "2", "--coordinator", coordinator] if replicas == 2 else []
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--server_num",
        str(pservers),
        "--worker_num",
        str(trainers),
        *hot_standby,
        "--log_dir",
        log_dir,
        JOB_S_SCRIPT,
        "--peers",
        args.peers,
        "--warmup",
        str(args.s_warmup),
        "--steps",
        str(args.s_steps),
        "--batch",
        str(args.s_batch),
        "--eval_examples",
        str(args.s_eval),
    ]
    if not sync:
        cmd.append("--async")
    if wire:
        cmd += ["--grad_wire_dtype", wire]
    if plain:
        cmd.append("--plain")
    if ram_rows:
        cmd += ["--ram_rows", str(ram_rows), "--table_disk_dir", os.path.join(workdir, "disk-tier")]
    cmd += list(extra)
    run_command(
        cmd,
        os.path.join(workdir, "launch.log"),
        args.timeout,
        f"ps-launch job_s.py ({pservers} ps x {trainers} trainers, {'sync' if sync else 'async'})",
        env={"PYTHONPATH": pythonpath_with_repo()},
        cwd=REPO,
    )
    res = job_s_results(log_dir, trainers)
    span = max(r["end"] for r in res) - min(r["start"] for r in res)
    out = {
        "examples_s": sum(r["examples"] for r in res) / span,
        "auc": res[0].get("auc"),
        "pservers": pservers,
        "trainers": trainers,
    }
    for key in ("calls_per_step", "bytes_pushed_per_step", "bytes_pulled_per_step", "compute_ms", "step_ms"):
        out[key] = statistics.mean(r[key] for r in res)
    out["detail"] = res
    return out


def venv_problem(python: str, module: str, setup: str) -> Optional[str]:
    """Why a peer needing ``module`` cannot run with ``python`` (None: it can); ``setup`` makes its venv."""
    if not os.path.isfile(python):
        return f"{python} does not exist (run shared/peers/{setup})"
    try:
        r = subprocess.run(
            [python, "-c", f"import {module}"],
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} -c 'import {module}' failed: {e}"
    if r.returncode != 0:
        return f"{python} cannot import {module}: {(r.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def run_torchrec(args, workdir: str) -> dict:
    """Job S on TorchRec 1.8 (2 processes, one thread each) through torchrec_ctr.py; its JSON line."""
    cmd = [
        args.torchrec_python,
        os.path.join(args.peers, "torchrec_ctr.py"),
        "--steps",
        str(args.s_steps),
        "--warmup",
        str(args.s_warmup),
        "--batch",
        str(args.s_batch),
    ]
    what = "torchrec_ctr.py"
    r = last_json_line(run_command(cmd, os.path.join(workdir, "torchrec.log"), args.timeout, what), what)
    return {"examples_s": r["examples_per_s"], "auc": r["auc"], "detail": r}


def run_paddle(args, workdir: str, sync: bool) -> dict:
    """Job S on PaddlePaddle 2.6.2's PS (2 pservers x 2 trainers) through paddle_ps_ctr.py; its summary."""
    mode = "sync" if sync else "async"
    out_json = os.path.join(workdir, "paddle.json")
    cmd = [
        args.paddle_python,
        os.path.join(args.peers, "paddle_ps_ctr.py"),
        "--mode",
        mode,
        "--data",
        "jobs",
        "--steps",
        str(args.s_steps),
        "--warmup",
        str(args.s_warmup),
        "--batch",
        str(args.s_batch),
        "--eval-examples",
        str(args.s_eval),
        "--timeout",
        str(args.timeout),
        "--retries",
        str(args.paddle_retries),
        "--log-dir",
        os.path.join(workdir, "paddle"),
        "--out",
        out_json,
    ]
    if sync:
        cmd += ["--server-rt-prio", "10"]  # Paddle 2.6's sync barrier deadlocks without it (needs root)
    what = f"paddle_ps_ctr.py --mode {mode}"
    run_command(cmd, os.path.join(workdir, "paddle.log"), args.timeout * (1 + args.paddle_retries) + 60, what)
    with open(out_json) as f:
        summary = json.load(f)
    r = summary["runs"][-1]
    if "global_examples_per_s" not in r:
        raise RunFailed(f"{what}: {r.get('error', 'no throughput')}")
    return {"examples_s": r["global_examples_per_s"], "auc": r.get("holdout_auc"), "detail": summary}


def run_ddp(args, workdir: str) -> dict:
    """Job D on DDP over gloo, 2 processes."""
    r = run_torch_peer(
        args,
        workdir,
        ["ddp-dense", "--warmup", str(args.d_warmup), "--steps", str(args.d_steps)],
        "torch_peers.py ddp-dense",
    )
    return {"examples_s": r["samples_per_s"], "detail": r}


def run_rpc_ps(args, workdir: str) -> dict:
    """Job D on the torch.distributed.rpc batch-updating PS, 2 pservers."""
    r = run_torch_peer(
        args,
        workdir,
        ["rpc-ps-dense", "--ps", "2", "--warmup", str(args.d_warmup), "--steps", str(args.d_steps)],
        "torch_peers.py rpc-ps-dense --ps 2",
    )
    return {"examples_s": r["samples_per_s"], "detail": r}


def run_ours_d(
    args, workdir: str, wire: Optional[str] = None, replicas: int = 1, coordinator: Optional[str] = None
) -> dict:
    """Job D on this project: 2 pservers x 2 trainers, sync, default config (or gradients pushed in ``wire``).

    ``replicas`` 2: a backup per pserver, etcd at ``coordinator`` (hot standby; :func:`dense_runs.run_ps`).
    """
    jobs = peer_module(args.peers, "jobs")
    spec = Spec(
        sizes=tuple(jobs.D_SIZES),
        batch=jobs.D_BATCH_PER_TRAINER,
        warmup=args.d_warmup,
        steps=args.d_steps,
        lr=jobs.D_LR,
        seed=0,
        sync_mode=True,
        timeout=args.timeout,
        peers=args.peers,
        grad_wire_dtype=wire,
    )
    workers, servers = run_ps(
        spec, workdir, args.timeout, jobs.D_TRAINERS, replicas=replicas, coordinator=coordinator
    )
    row = summarize("ps-sync", spec, workers, servers)
    losses = row.pop("losses")  # the loss after the last step: what a narrower wire costs in accuracy
    final_loss = statistics.mean(ls[-1] for ls in losses.values())
    per_step = {
        "calls_per_step": statistics.mean(w["pserver_calls"] for w in workers),
        "bytes_pushed_per_step": statistics.mean(w["bytes_pushed"] / w["steps"] for w in workers),
        "bytes_pulled_per_step": statistics.mean(w["bytes_pulled"] / w["steps"] for w in workers),
    }
    return {"examples_s": row["samples_s"], "final_loss": final_loss, **per_step, "detail": row}


def run_ours_collective_d(args, workdir: str) -> dict:
    """Job D on this project's collective mode: ``ps-launch --worker_num 2 job_d_collective.py``."""
    log_dir = os.path.join(workdir, "log")
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--worker_num",
        "2",
        "--log_dir",
        log_dir,
        JOB_D_COLLECTIVE,
        "--peers",
        args.peers,
        "--warmup",
        str(args.d_warmup),
        "--steps",
        str(args.d_steps),
    ]
    run_command(
        cmd,
        os.path.join(workdir, "launch.log"),
        args.timeout,
        "ps-launch job_d_collective.py (2 processes)",
        env={"PYTHONPATH": pythonpath_with_repo()},
        cwd=REPO,
    )
    (found,) = job_s_results(log_dir, 1)  # process 0 reports for both
    return {"examples_s": found["samples_per_s"], "detail": found}


RUNNERS = {
    ("S", "torch-local"): run_local_ctr,
    ("S", "torchrec"): run_torchrec,
    ("S", "ours-async"): lambda a, w: run_ours_s(a, w, sync=False),
    ("S", "ours-async-plain"): lambda a, w: run_ours_s(a, w, sync=False, plain=True),
    ("S", "ours-sync"): lambda a, w: run_ours_s(a, w, sync=True),
    ("S", "ours-sync-bf16"): lambda a, w: run_ours_s(a, w, sync=True, wire="bfloat16"),
    ("S", "paddle-async"): lambda a, w: run_paddle(a, w, sync=False),
    ("S", "paddle-sync"): lambda a, w: run_paddle(a, w, sync=True),
    ("D", "ddp"): run_ddp,
    ("D", "rpc-ps"): run_rpc_ps,
    ("D", "ours-sync"): run_ours_d,
    ("D", "ours-sync-bf16"): lambda a, w: run_ours_d(a, w, wire="bfloat16"),
    ("D", "ours-collective"): run_ours_collective_d,
}
