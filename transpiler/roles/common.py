"""What every role source shares: the role names, what a source finds (:class:`Role`), a
trainer's node of local processes (:class:`NodeEnv`) and the checks every source makes.

Every function here is pure: it reads only the mapping it is given and raises
ValueError naming the variable that is missing, malformed or contradicts another.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Union

PSERVER, TRAINER = "PSERVER", "TRAINER"
ROLES = (PSERVER, TRAINER)
# A trainer node's local processes: torchrun's names, which ps-launch --nproc_per_node sets too.
NODE_VARS = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
# The number of trainers, for sources whose engine does not say it (Kubernetes pods).
TRAINER_NUM_VARS = ("PS_TRAINER_NUM", "PADDLE_TRAINERS_NUM")
DEFAULT_PSERVER_PORT = 6170


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


def get_int(
    env: Mapping[str, str], name: str, default: Optional[int] = None, minimum: Optional[int] = None
) -> Optional[int]:
    """``env[name]`` as an integer (``default`` when unset or empty), at least ``minimum``."""
    value = env.get(name)
    if value is None or value.strip() == "":
        return default
    try:
        number = int(value)
    except ValueError:
        raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if minimum is not None and number < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {number}")
    return number


def get_port(env: Mapping[str, str], name: str, default: int) -> int:
    """``env[name]`` as a TCP port number (``default`` when unset)."""
    port = get_int(env, name, default)
    if not 0 < port < 65536:
        raise ValueError(f"{name} must be a port number (1-65535), got {port}")
    return port


def training_role(env: Mapping[str, str]) -> Optional[str]:
    """``TRAINING_ROLE`` upper-cased, or None when unset or empty; any other value than the roles raises."""
    role = env.get("TRAINING_ROLE")
    if not role:
        return None
    if role.upper() not in ROLES:
        raise ValueError(f"TRAINING_ROLE must be one of {ROLES}, got {role!r}")
    return role.upper()


def check_role(env: Mapping[str, str], derived: str, because: str) -> None:
    """Raise when ``TRAINING_ROLE`` is set and says otherwise than the engine (``because``)."""
    given = training_role(env)
    if given is not None and given != derived:
        raise ValueError(f"TRAINING_ROLE={given} contradicts {because}, which makes this process a {derived}")


def given_trainers(env: Mapping[str, str]) -> Optional[int]:
    """The trainer count from ``PS_TRAINER_NUM`` or ``PADDLE_TRAINERS_NUM``; None when neither is set."""
    ours, paddle = (get_int(env, name, minimum=1) for name in TRAINER_NUM_VARS)
    if ours is not None and paddle is not None and ours != paddle:
        raise ValueError(f"PS_TRAINER_NUM={ours} and PADDLE_TRAINERS_NUM={paddle} disagree; set one")
    return ours if ours is not None else paddle


def check_trainers(env: Mapping[str, str], trainers: int, because: str) -> None:
    """Raise when ``PS_TRAINER_NUM``/``PADDLE_TRAINERS_NUM`` is set to another count than the engine's."""
    given = given_trainers(env)
    if given is not None and given != trainers:
        name = next(n for n in TRAINER_NUM_VARS if env.get(n, "").strip())
        raise ValueError(f"{name}={given} contradicts {because}: {trainers} trainers")


def explicit_pservers(env: Mapping[str, str]) -> Optional[List[str]]:
    """``PADDLE_PSERVERS_IP_PORT_LIST`` parsed, or None when it is unset or blank."""
    text = env.get("PADDLE_PSERVERS_IP_PORT_LIST", "")
    if not text.strip():
        return None
    try:
        return parse_endpoints(text)
    except ValueError as e:
        raise ValueError(f"PADDLE_PSERVERS_IP_PORT_LIST: {e}") from None


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
        local_world_size = get_int(env, "LOCAL_WORLD_SIZE", 1)
        local_rank = get_int(env, "LOCAL_RANK", 0)
        if local_world_size < 1:
            raise ValueError(f"LOCAL_WORLD_SIZE must be >= 1, got {local_world_size}")
        if not 0 <= local_rank < local_world_size:
            raise ValueError(
                f"LOCAL_RANK={local_rank} is out of range [0, LOCAL_WORLD_SIZE={local_world_size})"
            )
        world_size = get_int(env, "WORLD_SIZE", local_world_size)
        rank = get_int(env, "RANK", local_rank)
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"RANK={rank} is out of range [0, WORLD_SIZE={world_size})")
        port = get_int(env, "MASTER_PORT", None)
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"MASTER_PORT must be a port number, got {port}")
        return cls(local_rank, local_world_size, env.get("MASTER_ADDR") or None, port, rank, world_size)

    def to_env(self) -> Dict[str, str]:
        """The variables that make :meth:`from_env` return this (what a launcher sets)."""
        env = {
            "LOCAL_RANK": str(self.local_rank),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "RANK": str(self.rank),
            "WORLD_SIZE": str(self.world_size),
        }
        if self.master_addr:
            env["MASTER_ADDR"] = self.master_addr
        if self.master_port:
            env["MASTER_PORT"] = str(self.master_port)
        return env


def collective_node(env: Mapping[str, str], trainers: int, trainer_id: int, trainers_from: str) -> NodeEnv:
    """A collective trainer's place in the whole job: RANK and WORLD_SIZE count every process of every node.

    Unset, they are ``trainer_id * LOCAL_WORLD_SIZE + LOCAL_RANK`` and
    ``trainers * LOCAL_WORLD_SIZE``; a WORLD_SIZE that says otherwise is an
    error naming ``trainers_from`` (where the trainer count came from).
    """
    given = {k: env[k] for k in NODE_VARS if env.get(k)}
    local = NodeEnv.from_env({k: v for k, v in given.items() if k not in ("RANK", "WORLD_SIZE")})
    world = trainers * local.local_world_size
    if "WORLD_SIZE" in given:
        node_world = NodeEnv.from_env({"WORLD_SIZE": given["WORLD_SIZE"]}).world_size  # an integer >= 1
        if node_world != world:
            raise ValueError(
                f"WORLD_SIZE={node_world} does not match {trainers_from}={trainers} x "
                f"LOCAL_WORLD_SIZE={local.local_world_size} = {world} (collective mode: every "
                f"process of every node is in one group)"
            )
    given.setdefault("WORLD_SIZE", str(world))
    given.setdefault("RANK", str(trainer_id * local.local_world_size + local.local_rank))
    return NodeEnv.from_env(given)


def local_node(env: Mapping[str, str]) -> NodeEnv:
    """A pserver-mode trainer's node: its own group of local processes, whatever RANK/WORLD_SIZE say.

    Engines (torchrun across nodes) set RANK and WORLD_SIZE for the whole job;
    with pservers each node is one trainer and its processes form their own
    group, so rank and size are the local ones.
    """
    return NodeEnv.from_env({k: env[k] for k in NODE_VARS if env.get(k) and k not in ("RANK", "WORLD_SIZE")})


def trainer_node(
    env: Mapping[str, str], pservers: Sequence[str], trainers: int, trainer_id: int, trainers_from: str
) -> NodeEnv:
    """The node of a trainer an engine found: the job's group without pservers, else the node's own."""
    if pservers:
        return local_node(env)
    return collective_node(env, trainers, trainer_id, trainers_from)


@dataclass
class Role:
    """What a source found: the fields of :class:`transpiler.roles.role_env.RoleEnv`, and which source
    found them."""

    role: str
    pservers: List[str]
    trainers: int
    trainer_id: int = 0
    current_endpoint: Optional[str] = None
    node: NodeEnv = field(default_factory=NodeEnv)
    source: str = ""
