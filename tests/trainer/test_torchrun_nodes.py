"""Trainer nodes under a multi-node torchrun: each node's group under its own prefix of torchrun's job-wide
store.

The decision (which rendezvous a node's processes use, from the environment) is a pure function, tested on
a table of real-looking environments; then 2 pservers and 2 real ``torchrun --nnodes 2 --nproc-per-node 2``
nodes train on CPU/gloo and end with single-process PyTorch's model: with the static rendezvous (the
agent's store at ``--master-addr:--master-port``) and with c10d's own store
(``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: the job's RANK 0 hosts it).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness.models import assert_state_close, odd_program, train_concatenated
from harness.ports import free_ports
from tests.helpers import paths, role_envs
from tests.helpers.launch import kill_probes
from tests.scripts import torchrun_node
from trainer.node import NodeRendezvous, SharedStore, join_group, node_rendezvous
from trainer.node.devices import open_store
from trainer.node.rendezvous import node_prefix

REPO = paths.REPO
SCRIPT = str(REPO / "tests" / "scripts" / "torchrun_node.py")
# Variables of an engine or launcher this test may itself run under: none may reach the roles.
INHERITED = (
    "PADDLE_",
    "PS_",
    "TRAINING_",
    "TORCHELASTIC_",
    "GROUP_",
    "ROLE_",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "RANK",
    "WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TF_CONFIG",
    "SLURM_",
    "JOB_COMPLETION_INDEX",
)

# What torchrun sets (torch.distributed.elastic's agent) for local rank 1 of node 1 of
# `torchrun --nnodes 2 --nproc-per-node 2 --master-addr node0 --master-port 29500` (static rendezvous).
TORCHRUN = {
    **role_envs.TORCHRUN,  # the same ranks and sizes role discovery reads
    "TORCHELASTIC_RUN_ID": "none",
    "TORCHELASTIC_MAX_RESTARTS": "0",
    "TRAINING_ROLE": "TRAINER",
    "PADDLE_PSERVERS_IP_PORT_LIST": "ps0:6170,ps1:6170",
}
# What ps-launch --nproc_per_node 2 gives local rank 1 of trainer node 3 (its own port per node).
PS_LAUNCH = {
    "TRAINING_ROLE": "TRAINER",
    "PADDLE_TRAINER_ID": "3",
    "PADDLE_TRAINERS_NUM": "4",
    "PADDLE_PSERVERS_IP_PORT_LIST": "ps0:6170",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "RANK": "1",
    "WORLD_SIZE": "2",
    "MASTER_ADDR": "10.0.0.5",
    "MASTER_PORT": "41000",
}
# A c10d rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: MASTER_PORT is a free port on node
# rank 0's host that no agent serves (the job's RANK 0 hosts it, as env:// would).
C10D_OWN_STORE = {
    **TORCHRUN,
    "TORCHELASTIC_USE_AGENT_STORE": "False",
    "TORCHELASTIC_RUN_ID": "ctr",
    "MASTER_ADDR": "gpu01.cluster",
    "MASTER_PORT": "45123",
}


# torch.distributed.TCPStore's timeout when none is given (its documented default).
TCPSTORE_DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


def shared(host, port, node, is_master, restart=0) -> NodeRendezvous:
    return NodeRendezvous(
        store=SharedStore(host, port, f"pserver_trainer_node{node}/restart{restart}", is_master)
    )


RENDEZVOUS = [
    # (case, environment, trainer id, local world size, init_method given, expected)
    ("ps-launch-node-own-port", PS_LAUNCH, 3, 2, None, NodeRendezvous(init_method="tcp://10.0.0.5:41000")),
    (
        "ps-launch-under-torchrun-leaks-torchrun-vars",
        {**PS_LAUNCH, "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_USE_AGENT_STORE": "True"},
        3,
        2,
        None,
        NodeRendezvous(init_method="tcp://10.0.0.5:41000"),
    ),
    (
        "torchrun-standalone-one-node",
        {
            **TORCHRUN,
            "RANK": "1",
            "WORLD_SIZE": "2",
            "GROUP_RANK": "0",
            "GROUP_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": "37001",
        },
        5,
        2,
        None,
        NodeRendezvous(init_method="tcp://127.0.0.1:37001"),
    ),
    ("torchrun-static-node1", TORCHRUN, 1, 2, None, shared("node0", 29500, 1, False)),
    (
        "torchrun-static-rank0-agent-hosts",
        {**TORCHRUN, "LOCAL_RANK": "0", "RANK": "0", "GROUP_RANK": "0"},
        0,
        2,
        None,
        shared("node0", 29500, 0, False),
    ),
    (
        "torchrun-restarted-workers",
        {**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "2"},
        1,
        2,
        None,
        shared("node0", 29500, 1, False, restart=2),
    ),
    ("torchrun-node-named-by-engine", TORCHRUN, 7, 2, None, shared("node0", 29500, 7, False)),
    (
        "c10d-own-store-rank0-hosts",
        {**C10D_OWN_STORE, "LOCAL_RANK": "0", "RANK": "0", "GROUP_RANK": "0"},
        0,
        2,
        None,
        shared("gpu01.cluster", 45123, 0, True),
    ),
    ("c10d-own-store-client", C10D_OWN_STORE, 1, 2, None, shared("gpu01.cluster", 45123, 1, False)),
    (
        "own-launcher-job-wide-ranks",
        {
            "LOCAL_RANK": "2",
            "LOCAL_WORLD_SIZE": "4",
            "RANK": "6",
            "WORLD_SIZE": "8",
            "MASTER_ADDR": "head",
            "MASTER_PORT": "29400",
        },
        1,
        4,
        None,
        shared("head", 29400, 1, False),
    ),
    (
        "init-method-given-wins",
        TORCHRUN,
        1,
        2,
        "tcp://10.1.1.1:4000",
        NodeRendezvous(init_method="tcp://10.1.1.1:4000"),
    ),
    ("nothing-set", {}, 0, 2, None, NodeRendezvous()),
    ("only-local-vars", {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 0, 2, None, NodeRendezvous()),
]


@pytest.mark.parametrize(
    "case,env,trainer_id,local_world_size,given,expected", RENDEZVOUS, ids=[row[0] for row in RENDEZVOUS]
)
def test_node_rendezvous_from_the_environment(case, env, trainer_id, local_world_size, given, expected):
    assert node_rendezvous(env, trainer_id, local_world_size, given) == expected


REFUSED = [
    (
        {**TORCHRUN, "MASTER_PORT": ""},
        "trainer node 1: WORLD_SIZE=4 counts the processes of several nodes, whose "
        "store is at MASTER_ADDR:MASTER_PORT, but MASTER_PORT is unset",
    ),
    (
        {k: v for k, v in TORCHRUN.items() if not k.startswith("MASTER_")},
        "but MASTER_ADDR and MASTER_PORT are unset",
    ),
    (
        {k: v for k, v in C10D_OWN_STORE.items() if k != "RANK"},
        "no torchrun agent hosts the store at gpu01.cluster:45123 (TORCHELASTIC_USE_AGENT_STORE is not "
        "True), so the "
        "job's RANK 0 must host it: set RANK",
    ),
    ({**TORCHRUN, "WORLD_SIZE": "four"}, "WORLD_SIZE must be an integer, got 'four'"),
    ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "-1"}, "TORCHELASTIC_RESTART_COUNT must be >= 0, got -1"),
    ({**TORCHRUN, "MASTER_PORT": "70000"}, "MASTER_PORT must be a port number (1-65535), got 70000"),
]


@pytest.mark.parametrize("env,message", REFUSED)
def test_node_rendezvous_refuses_what_it_cannot_use(env, message):
    with pytest.raises(ValueError) as e:
        node_rendezvous(env, 1, 2)
    assert message in str(e.value)


def test_a_store_nobody_hosts_fails_within_its_timeout_naming_who_should():
    (port,) = free_ports(1)
    spec = SharedStore("127.0.0.1", port, "pserver_trainer_node1/restart0", is_master=False)
    timeout = datetime.timedelta(seconds=1)
    started = time.monotonic()
    with pytest.raises(RuntimeError) as e:
        open_store(spec, timeout, "trainer node 1 local rank 1")
    elapsed = time.monotonic() - started
    # The promise (open_store): the client waits the timeout given for the store to answer, not TCPStore's
    # default (300 s). It waited (torch retries the connection until then, and once more after a delay of
    # up to about that timeout), and gave up long before the default: halfway between the two.
    assert timeout.total_seconds() <= elapsed < (timeout + TCPSTORE_DEFAULT_TIMEOUT).total_seconds() / 2
    assert (
        f"trainer node 1 local rank 1: the job's store at 127.0.0.1:{port} (MASTER_ADDR:MASTER_PORT): it did "
        f"not answer: torchrun's agent on node rank 0"
    ) in str(e.value)


def test_nodes_keep_their_keys_apart_in_one_store():
    """Two nodes' prefixes over one store (hosted here on loopback): the same key of each node holds its
    own value."""
    timeout = datetime.timedelta(seconds=10)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        server = dist.TCPStore(
            "127.0.0.1",
            port,
            is_master=True,
            wait_for_workers=False,
            timeout=timeout,
            master_listen_fd=listener.fileno(),
        )
        nodes = [
            open_store(SharedStore("127.0.0.1", port, node_prefix(n, 0), False), timeout, f"node {n}")
            for n in range(2)
        ]
        for n, store in enumerate(nodes):
            store.set("rank0", f"node {n}".encode())
        assert [store.get("rank0") for store in nodes] == [b"node 0", b"node 1"]
        assert server.get("pserver_trainer_node1/restart0/rank0") == b"node 1"


def test_a_job_wide_group_made_by_the_script_is_refused_with_the_reason():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(ValueError) as e:
            join_group(
                None,
                0,
                2,
                torch.device("cpu"),
                10,
                "trainer node 1 local rank 0",
                store=SharedStore("node0", 29500, "pserver_trainer_node1/restart0", False),
            )
        assert (
            "trainer node 1 local rank 0: torch.distributed is already initialised with 1 processes, "
            "expected 2; "
            "with pservers each trainer node is a process group of its own, which the Trainer makes"
        ) in str(e.value)
    finally:
        dist.destroy_process_group()


def clean_env(**more) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED)}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **more)
    return env


def start(cmd, env, log: Path) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )


def wait_all(procs: dict, logs: dict, timeout: float) -> dict:
    """Wait for every process in ``procs`` (name -> Popen) within ``timeout`` s; their exit codes."""
    deadline = time.monotonic() + timeout
    codes = {}
    for name, p in procs.items():
        try:
            codes[name] = p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish within {timeout}s\n{tails(logs)}")
    return codes


def tails(logs: dict) -> str:
    return "\n".join(
        f"===== {k}\n{v.read_text(errors='replace')[-4000:]}" for k, v in logs.items() if v.exists()
    )


def kill_all(procs: dict, out_dir: Path) -> None:
    """torchrun agents first (SIGTERM stops their workers), then whatever is left, workers included."""
    for p in procs.values():
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs.values():
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)
    kill_probes(out_dir, [b"torchrun_node"])


# How the nodes meet: torchrun's own rendezvous arguments, extra variables, and who hosts the store.
RENDEZVOUS_KINDS = {
    # --master-addr/--master-port: the agent of node rank 0 hosts the store at that address.
    "static": (
        lambda n, port: ["--node-rank", str(n), "--master-addr", "127.0.0.1", "--master-port", str(port)],
        {},
        "agent",
    ),
    # c10d without the shared store: MASTER_PORT is a free port of node rank 0 that the job's RANK 0 hosts.
    "c10d-own-store": (
        lambda n, port: [
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{port}",
            "--rdzv-id",
            "torchrun-nodes",
            "--local-addr",
            "127.0.0.1",
        ],
        {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
        "rank0",
    ),
}


@pytest.mark.processes
@pytest.mark.timeout(180)
@pytest.mark.parametrize("kind", sorted(RENDEZVOUS_KINDS))
def test_two_torchrun_nodes_of_two_processes_train_as_one_process(tmp_path, kind):
    rdzv_args, rdzv_env, host = RENDEZVOUS_KINDS[kind]
    ps_port_a, ps_port_b, master_port = free_ports(3)
    endpoints = [f"127.0.0.1:{ps_port_a}", f"127.0.0.1:{ps_port_b}"]
    out = tmp_path / "out"
    out.mkdir()
    procs, logs = {}, {}
    try:
        for i, ep in enumerate(endpoints):
            address, port = ep.rsplit(":", 1)
            logs[f"pserver{i}"] = tmp_path / f"pserver{i}.log"
            procs[f"pserver{i}"] = start(
                [sys.executable, "-m", "pserver.cli", "--program", "harness/models.py:odd_program"],
                clean_env(
                    TRAINING_ROLE="PSERVER",
                    PADDLE_PSERVERS_IP_PORT_LIST=",".join(endpoints),
                    PADDLE_TRAINERS_NUM="2",
                    POD_IP=address,
                    PADDLE_PORT=port,
                ),
                logs[f"pserver{i}"],
            )
        nodes = {}
        for n in range(2):
            logs[f"node{n}"] = tmp_path / f"node{n}.log"
            nodes[f"node{n}"] = procs[f"node{n}"] = start(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    *rdzv_args(n, master_port),
                    "--nproc-per-node",
                    "2",
                    "--max-restarts",
                    "0",
                    SCRIPT,
                    str(out),
                ],
                clean_env(
                    TRAINING_ROLE="TRAINER",
                    PADDLE_PSERVERS_IP_PORT_LIST=",".join(endpoints),
                    GLOO_SOCKET_IFNAME="lo",
                    **rdzv_env,
                ),
                logs[f"node{n}"],
            )
        codes = wait_all(nodes, logs, 120)
        assert codes == {"node0": 0, "node1": 0}, tails(logs)
        # The pservers saw two trainers (the nodes) close, and exit by themselves.
        codes = wait_all({k: p for k, p in procs.items() if k.startswith("pserver")}, logs, 30)
        assert codes == {"pserver0": 0, "pserver1": 0}, tails(logs)
        for i in range(2):
            assert "all 2 trainers closed" in logs[f"pserver{i}"].read_text(), tails(logs)
    finally:
        kill_all(procs, out)

    # Every process joined its node's group through the one store, under its node's prefix.
    text = "\n".join(logs[f"node{n}"].read_text(errors="replace") for n in range(2))
    stores = set()
    for n in range(2):
        for r in range(2):
            how = "hosting" if host == "rank0" and (n, r) == (0, 0) else "through"
            found = re.findall(
                rf"trainer node {n} local rank {r}: joining the node's process group as rank {r} "
                rf"of 2 {how} the job's store at 127\.0\.0\.1:(\d+) under prefix "
                rf"'pserver_trainer_node{n}/restart0' \(gloo\)",
                text,
            )
            assert len(found) == 1, text[-6000:]
            stores.add(int(found[0]))
    assert len(stores) == 1 and (host != "agent" or stores == {master_port}), stores
    expected = train_concatenated(odd_program(), torchrun_node.data())
    for n in range(2):
        for r in range(2):
            state, steps, trainer_id = torch.load(out / f"node{n}-rank{r}.pt", weights_only=False)
            assert (steps, trainer_id) == (torchrun_node.STEPS, n)
            assert_state_close(state, expected, atol=1e-9)
