"""Roles from the environment, as Paddle's launcher (and ps-launch) sets them.

=============================== =========================================
``TRAINING_ROLE``               ``PSERVER`` or ``TRAINER``
``PADDLE_PSERVERS_IP_PORT_LIST`` every pserver endpoint, comma-separated
``PADDLE_TRAINERS_NUM``         number of trainers
``PADDLE_TRAINER_ID``           this trainer's id (trainers only)
``POD_IP`` + ``PADDLE_PORT``    this pserver's own endpoint (pservers only)
=============================== =========================================

A trainer node may run several local processes (one per GPU); each also reads
:class:`NodeEnv`'s variables, as torchrun and ``ps-launch --nproc_per_node`` set them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Union


PSERVER, TRAINER = "PSERVER", "TRAINER"
ROLES = (PSERVER, TRAINER)
# Every variable a role reads; a launcher sets these and drops inherited ones.
ROLE_VARS = ("TRAINING_ROLE", "PADDLE_PSERVERS_IP_PORT_LIST", "PADDLE_TRAINERS_NUM",
             "PADDLE_TRAINER_ID", "POD_IP", "PADDLE_PORT")
# A trainer node's local processes: torchrun's names, which ps-launch --nproc_per_node sets too.
NODE_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def parse_endpoints(pservers: Union[str, Sequence[str]]) -> List[str]:
    """Turn ``"h1:p1,h2:p2"`` (or a list) into a checked list of endpoints."""
    items = pservers.split(",") if isinstance(pservers, str) else list(pservers)
    endpoints = [e.strip() for e in items if e.strip()]
    if not endpoints:
        raise ValueError("pservers is empty: give at least one 'host:port' endpoint")
    for ep in endpoints:
        host, sep, port = ep.rpartition(":")
        if not sep or not host or not port.isdigit() or not (0 < int(port) < 65536):
            raise ValueError(f"pserver endpoint {ep!r} is not of the form host:port")
    dupes = sorted({e for e in endpoints if endpoints.count(e) > 1})
    if dupes:
        raise ValueError(f"pserver endpoints listed twice: {dupes}")
    return endpoints


@dataclass
class NodeEnv:
    """This process's place among the local processes of its trainer node.

    ``master_addr:master_port`` is where the process group of these processes
    meets (``torch.distributed``'s ``tcp://`` rendezvous): the node's own
    group in pserver mode, the whole job's in collective mode, where ``rank``
    and ``world_size`` count every process of every node.
    """

    local_rank: int = 0
    local_world_size: int = 1
    master_addr: Optional[str] = None
    master_port: Optional[int] = None
    rank: int = 0
    world_size: int = 1

    @property
    def init_method(self) -> Optional[str]:
        """``tcp://MASTER_ADDR:MASTER_PORT``, or None when either is unset."""
        if not self.master_addr or not self.master_port:
            return None
        return f"tcp://{self.master_addr}:{self.master_port}"

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "NodeEnv":
        """Read LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE.

        Unset variables mean one process per node (local rank 0 of 1); RANK
        and WORLD_SIZE default to the local ones. Raises ValueError naming a
        malformed or inconsistent variable.
        """
        env = os.environ if environ is None else environ

        def get_int(name: str, default: Optional[int]) -> Optional[int]:
            value = env.get(name)
            if value is None or value == "":
                return default
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None

        local_world_size = get_int("LOCAL_WORLD_SIZE", 1)
        local_rank = get_int("LOCAL_RANK", 0)
        if local_world_size < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
        if not 0 <= local_rank < local_world_size:
            raise ValueError(f"LOCAL_RANK={local_rank} is out of range [0, LOCAL_WORLD_SIZE={local_world_size})")
        world_size = get_int("WORLD_SIZE", local_world_size)
        rank = get_int("RANK", local_rank)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is out of range [0, WORLD_SIZE={world_size})")
        port = get_int("MASTER_PORT", None)
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT must be a port number, got {port}")
        return cls(local_rank, local_world_size, env.get("MASTER_ADDR") or None, port, rank, world_size)

    def to_env(self) -> Dict[str, str]:
        """The variables that make :meth:`from_env` return this (what a launcher sets)."""
        env = {"LOCAL_RANK": str(self.local_rank), "LOCAL_WORLD_SIZE": str(self.local_world_size),
               "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size)}
        if self.master_addr:
            env["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            env["MASTER_PORT"] = str(self.master_port)
        return env


@dataclass
class RoleEnv:
    """This process's role in a distributed job."""

    role: str
    pservers: List[str]
    trainers: int
    trainer_id: int = 0
    current_endpoint: Optional[str] = None

    @property
    def is_pserver(self) -> bool:
        return self.role == PSERVER

    @property
    def pserver_list(self) -> str:
        return ",".join(self.pservers)

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["RoleEnv"]:
        """Read the role variables; None when ``TRAINING_ROLE`` is unset (a local run).

        Raises ValueError naming the variable that is missing or malformed.
        """
        env = os.environ if environ is None else environ
        role = env.get("TRAINING_ROLE")
        if not role:
            return None
        role = role.upper()
        if role not in ROLES:
            raise ValueError(f"TRAINING_ROLE must be one of {ROLES}, got {env['TRAINING_ROLE']!r}")

        def need(name: str) -> str:
            value = env.get(name)
            if not value:
                raise ValueError(f"{name} is not set; a {role} needs it")
            return value

        def need_int(name: str) -> int:
            value = need(name)
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"{name} must be an integer, got {value!r}") from None

        pservers = parse_endpoints(need("PADDLE_PSERVERS_IP_PORT_LIST"))
        trainers = need_int("PADDLE_TRAINERS_NUM")
        if trainers < 1:
            raise ValueError(f"PADDLE_TRAINERS_NUM must be >= 1, got {trainers}")
        if role == TRAINER:
            trainer_id = need_int("PADDLE_TRAINER_ID")
            if not 0 <= trainer_id < trainers:
                raise ValueError(f"PADDLE_TRAINER_ID={trainer_id} is out of range [0, {trainers})")
            return cls(role, pservers, trainers, trainer_id=trainer_id)
        endpoint = f"{need('POD_IP')}:{need_int('PADDLE_PORT')}"
        if endpoint not in pservers:
            raise ValueError(f"this pserver's endpoint {endpoint} (POD_IP:PADDLE_PORT) is not in "
                             f"PADDLE_PSERVERS_IP_PORT_LIST={','.join(pservers)}")
        return cls(role, pservers, trainers, current_endpoint=endpoint)

    def to_env(self) -> Dict[str, str]:
        """The role variables that make :meth:`from_env` return this role (what a launcher sets)."""
        env = {"TRAINING_ROLE": self.role, "PADDLE_PSERVERS_IP_PORT_LIST": self.pserver_list,
               "PADDLE_TRAINERS_NUM": str(self.trainers)}
        if self.is_pserver:
            ip, _, port = (self.current_endpoint or "").rpartition(":")
            env.update(POD_IP=ip, PADDLE_PORT=port)
        else:
            env["PADDLE_TRAINER_ID"] = str(self.trainer_id)
        return env
