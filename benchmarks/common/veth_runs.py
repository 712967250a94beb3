"""Job D's roles in network namespaces, for ``bench_veth``: started with ``ip netns exec``
(:class:`NsProcesses`, ``jobs/veth_workers.py``'s roles), given their host's environment, placed by a host
layout; one run of this project's PS, DDP and the torch RPC PS (each waits for its roles and returns their
results), as :mod:`benchmarks.common.dense_runs` runs them on loopback.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Sequence, Tuple

from benchmarks.common.dense_runs import Processes
from benchmarks.reports.veth import Config
from harness.host_layouts import HostLayout
from harness.netns import IFNAME, Hosts, host_env

WORKERS = "benchmarks.jobs.veth_workers"
PSERVERS = 2
TRAINERS = 2
PSERVER_EXIT_GRACE = 30.0


# -- processes in namespaces ---------------------------------------------------


class NsProcesses(Processes):
    """``dense_runs.Processes`` whose children are ``veth_workers`` roles started inside a namespace."""

    workers = WORKERS

    def spawn_in(
        self, hosts: Hosts, host: int, name: str, role: str, env: Dict[str, str], extra: Sequence[str] = ()
    ) -> None:
        """Start ``python -m benchmarks.jobs.veth_workers role`` as ``name`` in ``host``'s namespace with
        ``env``."""
        self.start(name, hosts.cmd(host, *self.argv(name, role, extra)), env)


def role_env(hosts: Hosts, host: int, link: str, peers: str, **extra: str) -> Dict[str, str]:
    """Environment of a role in ``host``: its veth counters, the interface gloo/TensorPipe bind, ``extra``."""
    ifname = IFNAME if link == "veth" else "lo"
    counters = hosts.sysfs_counter_paths()
    return {
        **host_env(),
        "BENCH_VETH_COUNTERS": f"{counters['rx_bytes']},{counters['tx_bytes']}",
        "BENCH_PEERS_DIR": peers,
        "GLOO_SOCKET_IFNAME": ifname,
        "TP_SOCKET_IFNAME": ifname,
        "BENCH_GLOO_SOCKET_IFNAME": ifname,
        "BENCH_TP_SOCKET_IFNAME": ifname,
        **extra,
    }


class ConnectionSampler:
    """Counts ``host``'s established TCP connections to the other hosts every ``period`` s in a thread;
    ``peak`` is the most.

    Tells which TensorPipe channel carried the tensors across the veth: ``mpt_uv`` opens 16 TCP lanes per
    pipe, ``basic`` none beyond the pipe's own.
    """

    def __init__(self, hosts: Hosts, host: int, period: float = 0.5):
        self.hosts, self.host, self.period, self.peak = hosts, host, period, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="conn-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            self.peak = max(self.peak, self.hosts.tcp_connections(self.host))

    def __enter__(self) -> "ConnectionSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# -- one run of each system ------------------------------------------------------


def placed(layout: HostLayout, link: str) -> HostLayout:
    """Where the roles run: as ``layout`` across the veths, or every role on host 1 on loopback."""
    if link == "veth":
        return layout
    return HostLayout("lo", (1,) * len(layout.pservers), (1,) * len(layout.trainers))


def address(hosts: Hosts, host: int, link: str) -> str:
    """A role's address on ``host``: the host's own across the veths, 127.0.0.1 on loopback."""
    return hosts.ip(host) if link == "veth" else "127.0.0.1"


def run_ps(
    procs: NsProcesses, hosts: Hosts, link: str, ports: List[int], args
) -> Tuple[List[dict], List[dict]]:
    """2 pservers and 2 trainers placed by ``args.layout`` (all in host 1 on lo); (trainer results, pserver
    results)."""
    layout = placed(args.layout, link)
    endpoints = [f"{address(hosts, h, link)}:{p}" for h, p in zip(layout.pservers, ports)]
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints), "PADDLE_TRAINERS_NUM": str(TRAINERS)}
    servers = [f"pserver{i}" for i in range(PSERVERS)]
    trainers = [f"trainer{i}" for i in range(TRAINERS)]
    for name, host, port in zip(servers, layout.pservers, ports):
        procs.spawn_in(
            hosts,
            host,
            name,
            "pserver",
            role_env(
                hosts,
                host,
                link,
                args.peers,
                **common,
                TRAINING_ROLE="PSERVER",
                POD_IP=address(hosts, host, link),
                PADDLE_PORT=str(port),
            ),
        )
    for i, (name, host) in enumerate(zip(trainers, layout.trainers)):
        procs.spawn_in(
            hosts,
            host,
            name,
            "trainer",
            role_env(
                hosts, host, link, args.peers, **common, TRAINING_ROLE="TRAINER", PADDLE_TRAINER_ID=str(i)
            ),
        )
    procs.wait(trainers, time.monotonic() + args.timeout, "the trainers")
    procs.wait(
        servers, time.monotonic() + PSERVER_EXIT_GRACE, "the pservers to exit after all trainers closed"
    )
    return procs.results(trainers), procs.results(servers)


def ddp_hosts(layout: HostLayout) -> Tuple[int, ...]:
    """Where DDP's ranks run across the veths: one per host, as DDP is run across hosts."""
    trainers = layout.trainers
    return trainers if len(set(trainers)) == len(trainers) else tuple(range(1, len(trainers) + 1))


def run_ddp(procs: NsProcesses, hosts: Hosts, link: str, ports: List[int], args) -> List[dict]:
    """2 DDP ranks over gloo, one per host: the layout's trainer hosts, or hosts 1 and 2 where its trainers
    share one (``pair``); all in host 1 on lo. Rank 0's host is the master. Their results."""
    on = ddp_hosts(args.layout) if link == "veth" else (1,) * TRAINERS
    master = address(hosts, on[0], link)
    names = [f"ddp{r}" for r in range(TRAINERS)]
    for rank, name in enumerate(names):
        host = on[rank]
        procs.spawn_in(
            hosts,
            host,
            name,
            "ddp",
            role_env(
                hosts,
                host,
                link,
                args.peers,
                MASTER_ADDR=master,
                MASTER_PORT=str(ports[0]),
                RANK=str(rank),
                WORLD_SIZE=str(TRAINERS),
            ),
        )
    procs.wait(names, time.monotonic() + args.timeout, "the DDP ranks")
    return procs.results(names)


def run_rpc(procs: NsProcesses, hosts: Hosts, config: Config, ports: List[int], args) -> dict:
    """The torch RPC PS: ranks ps0, ps1 on the layout's pserver hosts, trainers on its trainer hosts (host
    1 on lo); rank 0's record."""
    link = config.link
    layout = placed(args.layout, link)
    master = address(hosts, layout.pservers[0], link)
    world = PSERVERS + TRAINERS
    tp = ["--transports", "uv", "--channels", args.tp_channels] if config.tcp_only else []
    names = [f"ps{r}" if r < PSERVERS else f"trainer{r - PSERVERS}" for r in range(world)]
    for rank, name in enumerate(names):
        host = layout.pservers[rank] if rank < PSERVERS else layout.trainers[rank - PSERVERS]
        procs.spawn_in(
            hosts,
            host,
            name,
            "rpc",
            role_env(hosts, host, link, args.peers, BENCH_MASTER_ADDR=master),
            [
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--ps",
                str(PSERVERS),
                "--init",
                f"tcp://{master}:{ports[0]}",
                *tp,
            ],
        )
    procs.wait(names, time.monotonic() + args.timeout, "the torch RPC ranks")
    return procs.results(["ps0"])[0]
