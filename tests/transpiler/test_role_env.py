"""RoleEnv's trainer nodes and collective mode: what scripts read from the variables ps-launch sets."""

from __future__ import annotations

import re

import pytest

from transpiler import RoleEnv
from transpiler.roles.role_env import NodeEnv

EPS = "127.0.0.1:6170,127.0.0.1:6171"
TRAINER = {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINERS_NUM": "2", "PADDLE_TRAINER_ID": "1"}
NODE = {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "7001"}


@pytest.mark.timeout(10)
def test_pserver_mode_trainer_reads_its_node():
    env = RoleEnv.from_env(
        {**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS, **NODE, "RANK": "1", "WORLD_SIZE": "2"}
    )
    assert not env.collective and env.pservers == EPS.split(",")
    assert env.node == NodeEnv(1, 2, "127.0.0.1", 7001, 1, 2)
    assert (env.local_rank, env.local_world_size, env.rank, env.world_size) == (1, 2, 1, 2)
    assert env.node.init_method == "tcp://127.0.0.1:7001"
    # RANK/WORLD_SIZE default to the node's (ps-launch sets them so anyway).
    assert RoleEnv.from_env({**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS, **NODE}).node == env.node
    # No node variables: one process per node, exactly as before.
    plain = RoleEnv.from_env({**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS})
    assert plain.node == NodeEnv() and (plain.local_rank, plain.local_world_size) == (0, 1)
    assert plain.to_env() == {**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("pservers", [None, "", "  "], ids=["unset", "empty", "blank"])
def test_trainer_without_pservers_is_collective(pservers):
    base = dict(TRAINER) if pservers is None else {**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": pservers}
    env = RoleEnv.from_env(base)
    assert env.collective and env.pservers == [] and env.pserver_list == ""
    # One process per node: the job's group is the nodes (rank = trainer id).
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (1, 2, 0, 1)
    # Several: rank = node * L + local rank, world = nodes * L, unless RANK/WORLD_SIZE say it.
    env = RoleEnv.from_env({**base, **NODE})
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert RoleEnv.from_env({**base, **NODE, "RANK": "3", "WORLD_SIZE": "4"}).node == env.node
    # torchrun's rank order may differ from PADDLE_TRAINER_ID's: RANK is taken as given.
    assert RoleEnv.from_env({**base, **NODE, "RANK": "0"}).rank == 0


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "env, message",
    [
        (
            {**TRAINER, **NODE, "WORLD_SIZE": "3"},
            "WORLD_SIZE=3 does not match PADDLE_TRAINERS_NUM=2 x LOCAL_WORLD_SIZE=2 = 4",
        ),
        ({**TRAINER, **NODE, "RANK": "4"}, "RANK=4 is out of range [0, WORLD_SIZE=4)"),
        ({**TRAINER, "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is out of range"),
        ({**TRAINER, "LOCAL_RANK": "one"}, "LOCAL_RANK must be an integer, got 'one'"),
        (
            {**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS, "LOCAL_WORLD_SIZE": "0"},
            "LOCAL_WORLD_SIZE must be >= 1",
        ),
        (
            {**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": EPS, "MASTER_PORT": "99999"},
            "MASTER_PORT must be a port",
        ),
        ({**TRAINER, "PADDLE_PSERVERS_IP_PORT_LIST": ","}, "pservers is empty"),
        (
            {
                "TRAINING_ROLE": "PSERVER",
                "PADDLE_TRAINERS_NUM": "2",
                "POD_IP": "127.0.0.1",
                "PADDLE_PORT": "6170",
            },
            "PADDLE_PSERVERS_IP_PORT_LIST is not set; a PSERVER needs it",
        ),
        (
            {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": "0"},
            "PADDLE_TRAINERS_NUM is not set; a TRAINER needs it",
        ),
        (
            {"TRAINING_ROLE": "TRAINER", "PADDLE_TRAINERS_NUM": "2"},
            "PADDLE_TRAINER_ID is not set; a TRAINER needs it",
        ),
    ],
)
def test_errors_name_the_variable(env, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        RoleEnv.from_env(env)


@pytest.mark.timeout(10)
def test_pserver_has_no_node():
    env = RoleEnv.from_env(
        {
            "TRAINING_ROLE": "PSERVER",
            "PADDLE_PSERVERS_IP_PORT_LIST": EPS,
            "PADDLE_TRAINERS_NUM": "2",
            "POD_IP": "127.0.0.1",
            "PADDLE_PORT": "6171",
            "LOCAL_RANK": "junk",
        }
    )  # not read by a pserver
    assert env.node == NodeEnv() and not env.collective


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "role",
    [
        RoleEnv("PSERVER", EPS.split(","), 2, current_endpoint="127.0.0.1:6171"),
        RoleEnv("TRAINER", EPS.split(","), 2, trainer_id=1),
        RoleEnv("TRAINER", EPS.split(","), 2, trainer_id=1, node=NodeEnv(1, 4, "10.0.0.2", 7001, 1, 4)),
        RoleEnv("TRAINER", [], 2, trainer_id=1, node=NodeEnv(1, 4, "10.0.0.1", 29500, 5, 8)),
        RoleEnv("TRAINER", [], 1, trainer_id=0),
    ],
    ids=["pserver", "trainer", "node", "collective", "collective-one"],
)
def test_to_env_round_trips(role):
    env = role.to_env()
    assert RoleEnv.from_env(env) == role
    assert ("PADDLE_PSERVERS_IP_PORT_LIST" in env) == bool(role.pservers)
