"""One run of the dense-MLP job: DDP ranks, or pservers and trainers, each its own OS process.

Each process runs a role of ``benchmarks.jobs.dense_workers`` (``python -m``, the repository on its
PYTHONPATH), logs to ``<workdir>/<name>.log`` and writes its result to ``<workdir>/<name>.json``.
``bench_dense``, ``bench_peers`` (job D) and ``bench_replication`` run the job through
:func:`run_ddp` and :func:`run_ps`; ``bench_veth`` starts the same roles inside network namespaces.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

from benchmarks.jobs.dense_workers import Spec
from harness.paths import pythonpath_with_repo
from harness.ports import free_ports
from harness.processes import RunFailed, die_with_parent, tail

WORKERS = "benchmarks.jobs.dense_workers"
PSERVERS = 2
# After the last trainer closes, pservers must exit on their own within this.
PSERVER_EXIT_GRACE = 30.0
# SIGTERM, then SIGKILL after this many seconds.
STOP_GRACE = 5.0


class Processes:
    """The child processes of one run; leaving the ``with`` block stops any still running.

    Each child runs ``python -m benchmarks.jobs.dense_workers <role>`` in its own session (so Ctrl-C
    reaches only this script, which then stops the children, and a stop
    reaches the child's own children too), logs to ``<dir>/<name>.log`` and
    writes its result to ``<dir>/<name>.json``. ``prefix`` (e.g. a profiler
    command) goes in front of the Python command.
    """

    workers = WORKERS  # the module whose roles the children run

    def __init__(self, workdir: str, spec: Spec, prefix: Sequence[str] = ()):
        self.workdir = workdir
        self.spec = spec
        self.prefix = list(prefix)
        self.procs: Dict[str, subprocess.Popen] = {}

    def __enter__(self) -> "Processes":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def path(self, name: str, ext: str) -> str:
        return os.path.join(self.workdir, f"{name}.{ext}")

    def argv(self, name: str, role: str, extra: Sequence[str] = ()) -> List[str]:
        """``python -m <workers> <role>`` for worker ``name``: the spec in, its result out, then ``extra``."""
        return [
            sys.executable,
            "-m",
            self.workers,
            role,
            "--spec",
            self.spec.to_json(),
            "--out",
            self.path(name, "json"),
            *extra,
        ]

    def start(self, name: str, cmd: Sequence[str], env: Dict[str, str]) -> None:
        """Run ``cmd`` as worker ``name`` with environment ``env``: its own session, its log, gone with us."""
        with open(self.path(name, "log"), "w") as log:
            self.procs[name] = subprocess.Popen(
                cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def spawn(self, name: str, role: str, env: Dict[str, str], profile: bool = False) -> None:
        """Start worker ``name`` in ``role`` with extra environment ``env``."""
        cmd = self.argv(name, role)
        if profile and self.prefix:
            cmd = [a.replace("{name}", name) for a in self.prefix] + cmd
        self.start(name, cmd, {**os.environ, "PYTHONPATH": pythonpath_with_repo(), **env})

    def wait(self, names: Sequence[str], deadline: float, what: str) -> None:
        """Until ``names`` all exit 0; raise RunFailed if any child fails or ``deadline`` passes.

        Every child is watched, not only ``names``: a pserver that dies
        early fails the run at once instead of leaving trainers waiting.
        """
        while True:
            for name, p in self.procs.items():
                rc = p.poll()
                if rc not in (None, 0):
                    raise RunFailed(
                        f"{name} exited with code {rc} while waiting for {what}; "
                        f"log {self.path(name, 'log')}:\n{tail(self.path(name, 'log'))}"
                    )
            if all(self.procs[n].poll() == 0 for n in names):
                return
            if time.monotonic() > deadline:
                late = [n for n in names if self.procs[n].poll() is None]
                raise RunFailed(
                    f"deadline passed while waiting for {what}: {late} still running; "
                    f"last lines of {late[0]}:\n{tail(self.path(late[0], 'log'))}"
                )
            time.sleep(0.1)

    def results(self, names: Sequence[str]) -> List[dict]:
        """The result JSON each of ``names`` wrote."""
        out = []
        for name in names:
            try:
                with open(self.path(name, "json")) as f:
                    out.append(json.load(f))
            except (OSError, ValueError) as e:
                raise RunFailed(f"{name} exited 0 but left no readable result: {e}") from None
        return out

    def stop(self) -> None:
        """SIGTERM every running child's process group, SIGKILL what is left after a grace."""
        running = [p for p in self.procs.values() if p.poll() is None]
        for p in running:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        for p in running:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=STOP_GRACE)


def run_ddp(spec: Spec, workdir: str, timeout: float, processes: int) -> Tuple[List[dict], List[dict]]:
    """``processes`` DDP ranks over gloo on loopback; returns (each rank's timings, no servers)."""
    (port,) = free_ports(1)
    names = [f"ddp{r}" for r in range(processes)]
    with Processes(workdir, spec) as procs:
        for rank, name in enumerate(names):
            procs.spawn(
                name,
                "ddp",
                {
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(processes),
                },
            )
        procs.wait(names, time.monotonic() + timeout, "the DDP ranks")
        return procs.results(names), []


def run_ps(
    spec: Spec,
    workdir: str,
    timeout: float,
    processes: int,
    per_node: int = 1,
    profile: Sequence[str] = (),
    replicas: int = 1,
    coordinator: Optional[str] = None,
) -> Tuple[List[dict], List[dict]]:
    """Two pservers and ``processes`` trainer processes; (each trainer process's timings, each pserver's CPU).

    ``per_node`` > 1 groups the processes into ``processes // per_node``
    trainer nodes (``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, each node meeting at
    its own ``MASTER_PORT``): the pservers then see one trainer per node.
    The pservers must exit by themselves once the trainers have closed.
    ``replicas`` 2 (hot standby) also starts a backup per pserver
    (``pserverN.replica``, not in the returned figures) and gives every role
    the ``PS_*`` replica variables, with etcd at ``coordinator`` and a key
    prefix of this run's own, as ps-launch does.
    """
    nodes = processes // per_node
    backups = PSERVERS if replicas == 2 else 0
    ports = free_ports(PSERVERS + backups + (nodes if per_node > 1 else 0))
    endpoints = [f"127.0.0.1:{p}" for p in ports[:PSERVERS]]
    replica_eps = [f"127.0.0.1:{p}" for p in ports[PSERVERS : PSERVERS + backups]]
    node_ports = ports[PSERVERS + backups :]
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints), "PADDLE_TRAINERS_NUM": str(nodes)}
    if replicas == 2:
        if not coordinator:
            raise ValueError("replicas=2 needs coordinator: the etcd URL that decides each shard's primary")
        common.update(
            {
                "PS_SERVER_REPLICAS": "2",
                "PS_REPLICA_ENDPOINTS": ",".join(replica_eps),
                "PS_COORDINATOR": coordinator,
                "PS_COORDINATOR_PREFIX": f"/torch-pserver/bench-dense-{secrets.token_hex(6)}",
            }
        )
    servers = [f"pserver{i}" for i in range(PSERVERS)]
    replica_names = [f"pserver{i}.replica" for i in range(backups)]
    trainers: List[Tuple[str, Dict[str, str]]] = []
    for node in range(nodes):
        for local in range(per_node):
            env = {**common, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(node)}
            if per_node > 1:
                env.update(
                    {
                        "LOCAL_RANK": str(local),
                        "LOCAL_WORLD_SIZE": str(per_node),
                        "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(node_ports[node]),
                    }
                )
            trainers.append((f"trainer{node}" + (f".{local}" if per_node > 1 else ""), env))
    names = [name for name, _ in trainers]
    with Processes(workdir, spec, profile) as procs:
        for name, ep in zip(servers + replica_names, endpoints + replica_eps):
            ip, port = ep.rsplit(":", 1)
            procs.spawn(
                name,
                "pserver",
                {**common, "TRAINING_ROLE": "PSERVER", "POD_IP": ip, "PADDLE_PORT": port},
                profile=True,
            )
        for name, env in trainers:
            procs.spawn(name, "trainer", env, profile=True)
        procs.wait(names, time.monotonic() + timeout, "the trainers")
        procs.wait(
            servers + replica_names,
            time.monotonic() + PSERVER_EXIT_GRACE,
            "the pservers to exit after all trainers closed",
        )
        return procs.results(names), procs.results(servers)
