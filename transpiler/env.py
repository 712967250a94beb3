"""Roles from the environment, as Paddle's launcher (and ps-launch) sets them.

=============================== =========================================
``TRAINING_ROLE``               ``PSERVER`` or ``TRAINER``
``PADDLE_PSERVERS_IP_PORT_LIST`` every pserver endpoint, comma-separated
``PADDLE_TRAINERS_NUM``         number of trainers
``PADDLE_TRAINER_ID``           this trainer's id (trainers only)
``POD_IP`` + ``PADDLE_PORT``    this pserver's own endpoint (pservers only)
=============================== =========================================

A trainer with no ``PADDLE_PSERVERS_IP_PORT_LIST`` (unset or empty) is a collective
trainer (``RoleEnv.collective``); a pserver always needs the list.

A trainer node may run several local processes (one per GPU); each also reads
:class:`NodeEnv`'s variables, as torchrun and ``ps-launch --nproc_per_node`` set them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
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
    """This process's role in a distributed job, and (trainers) its place in its node.

    A trainer with no pservers (``PADDLE_PSERVERS_IP_PORT_LIST`` unset or empty)
    is a *collective* trainer: ``pservers == []`` and :attr:`collective` is True;
    there ``node.rank``/``node.world_size`` count every process of every node and
    default to ``trainer_id * LOCAL_WORLD_SIZE + LOCAL_RANK`` and
    ``PADDLE_TRAINERS_NUM * LOCAL_WORLD_SIZE``. With pservers, ``node`` is the
    trainer node's own group (ps-launch sets ``RANK = LOCAL_RANK``,
    ``WORLD_SIZE = LOCAL_WORLD_SIZE``). Pservers have the default ``NodeEnv()``.
    """

    role: str
    pservers: List[str]
    trainers: int
    trainer_id: int = 0
    current_endpoint: Optional[str] = None
    node: NodeEnv = field(default_factory=NodeEnv)

    @property
    def is_pserver(self) -> bool:
        return self.role == PSERVER

    @property
    def collective(self) -> bool:
        """A trainer of a job with no pservers (collective / nccl2 mode)."""
        return self.role == TRAINER and not self.pservers

    @property
    def pserver_list(self) -> str:
        return ",".join(self.pservers)

    @property
    def local_rank(self) -> int:
        """This process's index among its node's processes (``LOCAL_RANK``)."""
        return self.node.local_rank

    @property
    def local_world_size(self) -> int:
        """How many processes its node runs (``LOCAL_WORLD_SIZE``)."""
        return self.node.local_world_size

    @property
    def rank(self) -> int:
        """Its rank in its process group (``RANK``): the node's in pserver mode, the job's in collective mode."""
        return self.node.rank

    @property
    def world_size(self) -> int:
        """The size of that process group (``WORLD_SIZE``)."""
        return self.node.world_size

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["RoleEnv"]:
        """Read the role variables (and a trainer's :class:`NodeEnv`); None when ``TRAINING_ROLE`` is unset.

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

        if role == TRAINER and not env.get("PADDLE_PSERVERS_IP_PORT_LIST", "").strip():
            pservers = []  # collective mode: trainers only
        else:
            pservers = parse_endpoints(need("PADDLE_PSERVERS_IP_PORT_LIST"))
        trainers = need_int("PADDLE_TRAINERS_NUM")
        if trainers < 1:
            raise ValueError(f"PADDLE_TRAINERS_NUM must be >= 1, got {trainers}")
        if role == TRAINER:
            trainer_id = need_int("PADDLE_TRAINER_ID")
            if not 0 <= trainer_id < trainers:
                raise ValueError(f"PADDLE_TRAINER_ID={trainer_id} is out of range [0, {trainers})")
            node = _collective_node(env, trainers, trainer_id) if not pservers else NodeEnv.from_env(env)
            return cls(role, pservers, trainers, trainer_id=trainer_id, node=node)
        endpoint = f"{need('POD_IP')}:{need_int('PADDLE_PORT')}"
        if endpoint not in pservers:
            raise ValueError(f"this pserver's endpoint {endpoint} (POD_IP:PADDLE_PORT) is not in "
                             f"PADDLE_PSERVERS_IP_PORT_LIST={','.join(pservers)}")
        return cls(role, pservers, trainers, current_endpoint=endpoint)

    def to_env(self) -> Dict[str, str]:
        """The variables that make :meth:`from_env` return this role (what a launcher sets).

        A collective trainer gets no ``PADDLE_PSERVERS_IP_PORT_LIST``; a trainer
        whose node is not the default ``NodeEnv()`` also gets the node's variables.
        """
        env = {"TRAINING_ROLE": self.role, "PADDLE_TRAINERS_NUM": str(self.trainers)}
        if self.pservers or self.is_pserver:
            env["PADDLE_PSERVERS_IP_PORT_LIST"] = self.pserver_list
        if self.is_pserver:
            ip, _, port = (self.current_endpoint or "").rpartition(":")
            env.update(POD_IP=ip, PADDLE_PORT=port)
        else:
            env["PADDLE_TRAINER_ID"] = str(self.trainer_id)
            if self.node != NodeEnv():
                env.update(self.node.to_env())
        return env


def _collective_node(env: Mapping[str, str], trainers: int, trainer_id: int) -> NodeEnv:
    """A collective trainer's place in the whole job: RANK and WORLD_SIZE count every process of every node.

    Unset, they are ``trainer_id * LOCAL_WORLD_SIZE + LOCAL_RANK`` and
    ``PADDLE_TRAINERS_NUM * LOCAL_WORLD_SIZE``; a WORLD_SIZE that says otherwise is an error.
    """
    given = {k: env[k] for k in NODE_VARS if env.get(k)}
    local = NodeEnv.from_env({k: v for k, v in given.items() if k not in ("RANK", "WORLD_SIZE")})
    world = trainers * local.local_world_size
    if "WORLD_SIZE" in given:
        node_world = NodeEnv.from_env({"WORLD_SIZE": given["WORLD_SIZE"]}).world_size  # an integer >= 1
        if node_world != world:
            raise ValueError(f"WORLD_SIZE={node_world} does not match PADDLE_TRAINERS_NUM={trainers} x "
                             f"LOCAL_WORLD_SIZE={local.local_world_size} = {world} (collective mode: every "
                             f"process of every node is in one group)")
    given.setdefault("WORLD_SIZE", str(world))
    given.setdefault("RANK", str(trainer_id * local.local_world_size + local.local_rank))
    return NodeEnv.from_env(given)
