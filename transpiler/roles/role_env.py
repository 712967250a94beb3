"""This process's role in a distributed job, from the environment its launcher or cluster engine set.

:meth:`RoleEnv.from_env` asks :mod:`transpiler.roles`, one source per engine, in this order:
explicit Paddle/ps-launch variables (``TRAINING_ROLE`` with ``PADDLE_TRAINER_ID`` or
``PADDLE_PORT``), Kubeflow's ``TF_CONFIG``, Kubernetes StatefulSet/Indexed Job pods
(``PS_PSERVER_SERVICE``, ``JOB_COMPLETION_INDEX``), Slurm (``SLURM_PROCID`` with
``PS_PSERVER_NUM``), torchrun (``GROUP_RANK``); then, with ``TRAINING_ROLE`` set, the Paddle
variables, whose errors name what is missing (the table in :mod:`transpiler.roles.paddle`).

A trainer with no pservers (``PADDLE_PSERVERS_IP_PORT_LIST`` unset or empty) is a collective
trainer (``RoleEnv.collective``); a pserver always needs the list.

A trainer node may run several local processes (one per GPU); each also reads
:class:`NodeEnv`'s variables, as torchrun and ``ps-launch --nproc_per_node`` set them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from . import discover
from .common import NODE_VARS, PSERVER, ROLES, TRAINER, NodeEnv, parse_endpoints
from .paddle import ROLE_VARS

__all__ = ["RoleEnv", "NodeEnv", "parse_endpoints", "PSERVER", "TRAINER", "ROLES", "ROLE_VARS", "NODE_VARS"]


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
    ``source`` names the engine the role came from (``"paddle"``, ``"kubeflow"``,
    ``"kubernetes"``, ``"slurm"``, ``"torchrun"``; ``None`` when built by hand); it
    takes no part in comparisons.
    """

    role: str
    pservers: List[str]
    trainers: int
    trainer_id: int = 0
    current_endpoint: Optional[str] = None
    node: NodeEnv = field(default_factory=NodeEnv)
    source: Optional[str] = field(default=None, compare=False)

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
        """Its rank in its process group (``RANK``): the node's in pserver mode, the job's in collective
        mode."""
        return self.node.rank

    @property
    def world_size(self) -> int:
        """The size of that process group (``WORLD_SIZE``)."""
        return self.node.world_size

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> Optional["RoleEnv"]:
        """This process's role from the environment (see the module docstring for the order of sources).

        None when no engine's variables are there and ``TRAINING_ROLE`` is unset (a
        local run). Raises ValueError naming the variable that is missing, malformed
        or contradicts another.
        """
        found = discover(os.environ if environ is None else environ)
        if found is None:
            return None
        return cls(
            found.role,
            list(found.pservers),
            found.trainers,
            trainer_id=found.trainer_id,
            current_endpoint=found.current_endpoint,
            node=found.node,
            source=found.source,
        )

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
