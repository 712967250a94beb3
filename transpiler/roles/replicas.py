"""Which processes serve each pserver shard: the hot-standby settings resolved (docs/recovery.md, "Hot
standby").

With ``server_replicas=2`` shard k is served by two processes, ``pservers[k]`` and
``replica_endpoints[k]``; either may lead. The plan's layout (blocks, placement, the digest trainers and
pservers check) depends only on ``pservers``, so a job's checkpoints load with or without replicas. Pure:
the environment is passed in.
"""

from __future__ import annotations

import dataclasses
from typing import List, Mapping

from ..config import DistributeTranspilerConfig
from . import kubernetes, slurm
from .common import parse_endpoints

REPLICAS_VAR = "PS_SERVER_REPLICAS"
ENDPOINTS_VAR = "PS_REPLICA_ENDPOINTS"
COORDINATOR_VAR = "PS_COORDINATOR"
PREFIX_VAR = "PS_COORDINATOR_PREFIX"
TTL_VAR = "PS_REPLICA_LEASE_TTL"


def resolve_replicas(
    config: DistributeTranspilerConfig, pservers: List[str], environ: Mapping[str, str]
) -> DistributeTranspilerConfig:
    """``config`` with the replica fields it left None filled from ``environ``, checked against ``pservers``.

    A new config: ``config`` itself is left as the user made it.

    ValueError names the field (or variable) that is wrong: a replica count other
    than 1 or 2, a backup list whose length differs from the pservers', an
    endpoint listed twice, or two replicas without a coordinator.
    """
    filled = {}
    if config.server_replicas is None:
        filled["server_replicas"] = _int_var(environ, REPLICAS_VAR, 1, "a replica count (1 or 2)")
    for field, var in (
        ("replica_endpoints", ENDPOINTS_VAR),
        ("coordinator", COORDINATOR_VAR),
        ("coordinator_prefix", PREFIX_VAR),
    ):
        if getattr(config, field) is None and environ.get(var, "").strip():
            filled[field] = environ[var].strip()
    if config.replica_lease_ttl is None:
        filled["replica_lease_ttl"] = _int_var(environ, TTL_VAR, 1, "a whole number of seconds")
    config = dataclasses.replace(config, **filled)
    if config.replica_endpoints is None and config.server_replicas == 2:
        # One StatefulSet of 2N pods, or one Slurm step whose first 2K tasks are pserver processes.
        derived = kubernetes.replica_endpoints(environ) or slurm.replica_endpoints(environ)
        if derived:
            config = dataclasses.replace(config, replica_endpoints=",".join(derived))
    config.validate()
    if config.server_replicas == 1:
        return config
    if not config.replica_endpoints:
        raise ValueError(
            f"server_replicas=2 needs replica_endpoints (or {ENDPOINTS_VAR}): the second "
            f"process of each of the {len(pservers)} pservers, in their order"
        )
    backups = parse_endpoints(config.replica_endpoints)
    if len(backups) != len(pservers):
        raise ValueError(
            f"replica_endpoints lists {len(backups)} endpoints for {len(pservers)} pservers; "
            f"give one backup per pserver, in the pservers' order"
        )
    both = pservers + backups
    twice = sorted({ep for ep in both if both.count(ep) > 1})
    if twice:
        raise ValueError(f"endpoints {twice} are listed more than once among the pservers and their replicas")
    if not config.coordinator:
        raise ValueError(
            f"server_replicas=2 needs a coordinator (or {COORDINATOR_VAR}): the etcd URLs "
            f"that decide each shard's primary, e.g. http://127.0.0.1:2379"
        )
    return config


def _int_var(environ: Mapping[str, str], var: str, default: int, what: str) -> int:
    """The integer in ``environ[var]``, ``default`` when unset or empty; ValueError naming it otherwise."""
    text = environ.get(var, "").strip()
    try:
        return int(text) if text else default
    except ValueError:
        raise ValueError(f"{var}={text!r} is not {what}") from None


def replica_endpoints(config: DistributeTranspilerConfig, pservers: List[str]) -> List[List[str]]:
    """Each shard's processes, ``[[pservers[k], backup_k], ...]`` (one each without replicas)."""
    if (config.server_replicas or 1) == 1 or not config.replica_endpoints:
        return [[ep] for ep in pservers]
    return [[ep, backup] for ep, backup in zip(pservers, parse_endpoints(config.replica_endpoints))]
