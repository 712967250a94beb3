"""ps-launch's plans of trainer nodes: local ranks, node variables, GPUs, collective mode, free ports, the
table's node columns (the pure pieces; the rest of the plan: tests/launch/test_plan.py)."""

from __future__ import annotations

import socket

import pytest

from tests.helpers.launch import args_for
from trainer import launch
from trainer.launch import hosts
from trainer.launch import plan as launch_plan
from trainer.launch.plan import PSERVER, TRAINER
from trainer.launch.role import child_env
from transpiler import RoleEnv
from transpiler.roles.role_env import NODE_VARS, NodeEnv

PORTS = lambda n: [7100 + i for i in range(n)]  # noqa: E731  the free ports a plan gets, in order
NODE_KEYS = (*NODE_VARS, "CUDA_VISIBLE_DEVICES", "PADDLE_PSERVERS_IP_PORT_LIST")


@pytest.mark.timeout(10)
def test_child_env_drops_inherited_node_variables():
    # ps-launch run under torchrun (or inside another job): its LOCAL_RANK etc. must not leak.
    base = {
        "PATH": "/bin",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.9.9.9",
        "MASTER_PORT": "1234",
        "RANK": "7",
        "WORLD_SIZE": "16",
        "CUDA_VISIBLE_DEVICES": "1",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "1",
        "ROLE_NAME": "default",
    }
    one = launch_plan.plan_roles(
        args_for("--server_num", "1", "--worker_num", "1"), pick_ports=PORTS, environ={}
    )
    for role in one:
        env = child_env(role, base)
        assert not set(NODE_VARS) & set(env), role.name
        assert not [k for k in env if k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))], role.name
        assert env["PATH"] == "/bin"
        # No --gpus: trainers keep the launcher's GPUs, pservers none.
        assert env["CUDA_VISIBLE_DEVICES"] == ("" if role.kind == PSERVER else "1")
        assert RoleEnv.from_env(env).node == NodeEnv()
    two = launch_plan.plan_roles(
        args_for("--server_num", "1", "--worker_num", "1", "--nproc_per_node", "2"),
        pick_ports=PORTS,
        environ={},
    )
    for role in two[1:]:
        env = child_env(role, base)
        assert RoleEnv.from_env(env).node == NodeEnv(
            role.local_rank, 2, "127.0.0.1", 7101, role.local_rank, 2
        )


def proc(local_rank, nproc, addr, port, rank=None, world=None, gpus=None):
    """The node variables (and CUDA_VISIBLE_DEVICES) one trainer process must get."""
    env = {
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "RANK": str(local_rank if rank is None else rank),
        "WORLD_SIZE": str(nproc if world is None else world),
    }
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


LOCAL2 = "127.0.0.1:7100,127.0.0.1:7101"
# (argv, this host (None: local mode), launcher's environ, pserver list (None: collective), nodes,
#  {process name: the variables of NODE_KEYS it gets; any other of NODE_KEYS must be absent}).
PLANS = {
    "one-process-nodes-keep-todays-env": (
        ["--server_num", "2", "--worker_num", "2"],
        None,
        {},
        LOCAL2,
        2,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "pserver.1": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0": {},
            "trainer.1": {},
        },
    ),
    "nproc-2-local": (
        ["--server_num", "2", "--worker_num", "2", "--nproc_per_node", "2"],
        None,
        {},
        LOCAL2,
        2,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "pserver.1": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0.0": proc(0, 2, "127.0.0.1", 7102),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 7102),
            "trainer.1.0": proc(0, 2, "127.0.0.1", 7103),
            "trainer.1.1": proc(1, 2, "127.0.0.1", 7103),
        },
    ),
    "nproc-2-start-port-avoided": (
        ["--server_num", "2", "--worker_num", "1", "--nproc_per_node", "2", "--start_port", "7100"],
        None,
        {},
        LOCAL2,
        1,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "pserver.1": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0.0": proc(0, 2, "127.0.0.1", 7102),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 7102),
        },
    ),
    "nproc-2-master-port": (
        ["--server_num", "1", "--worker_num", "2", "--nproc_per_node", "2", "--master_port", "8000"],
        None,
        {},
        "127.0.0.1:7100",
        2,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0.0": proc(0, 2, "127.0.0.1", 8000),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 8000),
            "trainer.1.0": proc(0, 2, "127.0.0.1", 8001),
            "trainer.1.1": proc(1, 2, "127.0.0.1", 8001),
        },
    ),
    "gpus-split-among-local-nodes": (
        ["--server_num", "1", "--worker_num", "2", "--gpus", "0,1,2,3"],
        None,
        {},
        "127.0.0.1:7100",
        2,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0.0": proc(0, 2, "127.0.0.1", 7101, gpus="0,1"),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 7101, gpus="0,1"),
            "trainer.1.0": proc(0, 2, "127.0.0.1", 7102, gpus="2,3"),
            "trainer.1.1": proc(1, 2, "127.0.0.1", 7102, gpus="2,3"),
        },
    ),
    "gpus-fewer-processes": (
        ["--server_num", "1", "--worker_num", "1", "--gpus", "4,6,7", "--nproc_per_node", "2"],
        None,
        {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
        "127.0.0.1:7100",
        1,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0.0": proc(0, 2, "127.0.0.1", 7101, gpus="4,6"),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 7101, gpus="4,6"),
        },
    ),
    "gpus-one-each": (
        ["--server_num", "1", "--worker_num", "2", "--gpus", "3,1"],
        None,
        {},
        "127.0.0.1:7100",
        2,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0": {"CUDA_VISIBLE_DEVICES": "3"},
            "trainer.1": {"CUDA_VISIBLE_DEVICES": "1"},
        },
    ),
    "per-host-nproc-2": (
        [
            "--servers",
            "10.0.0.1:6170,10.0.0.2:6170",
            "--workers",
            "10.0.0.1,10.0.0.2,10.0.0.1",
            "--nproc_per_node",
            "2",
            "--gpus",
            "0,1,2,3",
        ],
        "10.0.0.1",
        {},
        "10.0.0.1:6170,10.0.0.2:6170",
        3,
        {
            "pserver.0": {"CUDA_VISIBLE_DEVICES": ""},
            "trainer.0.0": proc(0, 2, "10.0.0.1", 7100, gpus="0,1"),
            "trainer.0.1": proc(1, 2, "10.0.0.1", 7100, gpus="0,1"),
            "trainer.2.0": proc(0, 2, "10.0.0.1", 7101, gpus="2,3"),
            "trainer.2.1": proc(1, 2, "10.0.0.1", 7101, gpus="2,3"),
        },
    ),
    "per-host-nproc-2-master-port": (
        [
            "--servers",
            "10.0.0.1:6170",
            "--workers",
            "10.0.0.1,10.0.0.2",
            "--nproc_per_node",
            "2",
            "--master_port",
            "6170",
        ],
        "10.0.0.2",
        {},
        "10.0.0.1:6170",
        2,
        {"trainer.1.0": proc(0, 2, "10.0.0.2", 6170), "trainer.1.1": proc(1, 2, "10.0.0.2", 6170)},
    ),
    "collective-local": (
        ["--worker_num", "2", "--nproc_per_node", "2"],
        None,
        {},
        None,
        2,
        {
            "trainer.0.0": proc(0, 2, "127.0.0.1", 7100, 0, 4),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 7100, 1, 4),
            "trainer.1.0": proc(0, 2, "127.0.0.1", 7100, 2, 4),
            "trainer.1.1": proc(1, 2, "127.0.0.1", 7100, 3, 4),
        },
    ),
    "collective-one-process-nodes": (
        ["--worker_num", "3", "--master_port", "6000"],
        None,
        {},
        None,
        3,
        {
            "trainer.0": proc(0, 1, "127.0.0.1", 6000, 0, 3),
            "trainer.1": proc(0, 1, "127.0.0.1", 6000, 1, 3),
            "trainer.2": proc(0, 1, "127.0.0.1", 6000, 2, 3),
        },
    ),
    "collective-gpus": (
        ["--worker_num", "1", "--gpus", "0,1"],
        None,
        {},
        None,
        1,
        {
            "trainer.0.0": proc(0, 2, "127.0.0.1", 7100, 0, 2, gpus="0,1"),
            "trainer.0.1": proc(1, 2, "127.0.0.1", 7100, 1, 2, gpus="0,1"),
        },
    ),
    "collective-per-host": (
        ["--workers", "10.0.0.1,10.0.0.2", "--nproc_per_node", "2"],
        "10.0.0.2",
        {},
        None,
        2,
        {
            "trainer.1.0": proc(0, 2, "10.0.0.1", 29500, 2, 4),
            "trainer.1.1": proc(1, 2, "10.0.0.1", 29500, 3, 4),
        },
    ),
    "collective-per-host-master-port": (
        ["--workers", "10.0.0.1,10.0.0.2", "--nproc_per_node", "2", "--master_port", "7777"],
        "10.0.0.1",
        {},
        None,
        2,
        {
            "trainer.0.0": proc(0, 2, "10.0.0.1", 7777, 0, 4),
            "trainer.0.1": proc(1, 2, "10.0.0.1", 7777, 1, 4),
        },
    ),
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", PLANS.values(), ids=PLANS.keys())
def test_node_plans(case):
    argv, host, environ, pservers, nodes, expected = case
    is_local = (lambda h: h == host) if host else None
    roles = launch_plan.plan_roles(args_for(*argv), is_local=is_local, pick_ports=PORTS, environ=environ)
    assert [r.name for r in roles] == list(expected)
    for role in roles:
        env = role.env
        assert {k: env[k] for k in NODE_KEYS if k in env and k != "PADDLE_PSERVERS_IP_PORT_LIST"} == expected[
            role.name
        ], role.name
        assert env.get("PADDLE_PSERVERS_IP_PORT_LIST") == pservers
        assert env["PADDLE_TRAINERS_NUM"] == str(nodes) and env["TRAINING_ROLE"] == role.kind
        parsed = RoleEnv.from_env(child_env(role, {}))
        if role.kind == TRAINER:
            assert env["PADDLE_TRAINER_ID"] == str(role.index)
            assert parsed.collective == (pservers is None)
            assert (parsed.local_rank, parsed.local_world_size) == (role.local_rank, role.local_world_size)
            assert role.log_name == f"workerlog.{role.index}" + (
                f".{role.local_rank}" if role.local_rank else ""
            )
        else:
            assert parsed.current_endpoint == role.endpoint and parsed.node == NodeEnv()


@pytest.mark.timeout(10)
def test_free_ports_are_real_and_distinct_for_nodes():
    roles = launch_plan.plan_roles(
        args_for("--server_num", "2", "--worker_num", "2", "--nproc_per_node", "2"), environ={}
    )
    ports = {r.endpoint.rpartition(":")[2] for r in roles if r.kind == PSERVER}
    ports |= {r.env["MASTER_PORT"] for r in roles if r.kind == TRAINER}
    assert len(ports) == 4
    roles = launch_plan.plan_roles(args_for("--worker_num", "2", "--nproc_per_node", "2"), environ={})
    assert len({r.env["MASTER_PORT"] for r in roles}) == 1


@pytest.mark.timeout(10)
def test_free_ports_lie_outside_the_kernels_ephemeral_range_and_bind():
    """A port the kernel may hand to any bind to port 0 (a data port) or outgoing connection before the role
    binds it is never picked: a role then cannot find its port taken by another process's socket."""
    first, last = hosts.ephemeral_range()
    ports = hosts.free_ports(16)
    assert len(set(ports)) == 16
    assert all(p < first or p > last for p in ports), (ports, first, last)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


@pytest.mark.timeout(10)
def test_table_shows_node_and_local_rank():
    roles = launch_plan.plan_roles(
        args_for("--server_num", "1", "--worker_num", "2", "--nproc_per_node", "2"),
        pick_ports=PORTS,
        environ={},
    )
    rows = launch.format_table(roles).splitlines()
    assert rows[1].split()[:3] == ["PSERVER", "0", "127.0.0.1:7100"]
    assert "trainer node 1 local rank 1/2 on 127.0.0.1" in rows[5] and rows[5].split()[:2] == ["TRAINER", "1"]
    roles = launch_plan.plan_roles(
        args_for("--worker_num", "2", "--nproc_per_node", "2"), pick_ports=PORTS, environ={}
    )
    rows = launch.format_table(roles).splitlines()
    assert "trainer node 1 local rank 0/2 rank 2/4 on 127.0.0.1" in rows[3]
    assert roles[3].title == "trainer node 1 local rank 1" and roles[3].name == "trainer.1.1"
