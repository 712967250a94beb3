"""Kubeflow's ``TF_CONFIG``, exactly as the TFJob operator writes it into every replica's pod::

    {"cluster": {"ps": ["job-ps-0.ns.svc:6170", ...], "worker": ["job-worker-0.ns.svc:6170", ...],
                 "chief": [...]},                      # chief (or the older "master"): optional
     "task": {"type": "ps" | "worker" | "chief", "index": N}, "environment": "cloud"}

``ps`` replicas are the pservers (``ps[N]`` is this one's endpoint); the chief, if the
job has one, is trainer 0 and ``worker`` N is trainer ``N + 1`` (trainer N without a
chief). A job without ``ps`` replicas is collective; its trainers meet at trainer 0's
address unless ``MASTER_ADDR``/``MASTER_PORT`` say otherwise. An ``evaluator`` has no role
in a parameter-server job, and a ``sparseCluster`` (``enableDynamicWorker``) lists no other
worker, so both are refused.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional

from .common import PSERVER, TRAINER, Role, check_role, check_trainers, parse_endpoints, trainer_node

LEADERS = ("chief", "master")  # "master" is the TFJob operator's older name for the chief


def discover(env: Mapping[str, str]) -> Optional[Role]:
    """This replica's role from ``TF_CONFIG``; None when it is unset or blank."""
    text = env.get("TF_CONFIG", "")
    if not text.strip():
        return None
    config = _load(text)
    cluster, task = config["cluster"], config["task"]
    pservers = _endpoints(cluster, "ps")
    leaders = [ep for kind in LEADERS for ep in _endpoints(cluster, kind)]
    if len(leaders) > 1:
        raise ValueError(
            f"TF_CONFIG's cluster has {len(leaders)} chief/master replicas {leaders}; at most one"
        )
    trainers = leaders + _endpoints(cluster, "worker")
    if not trainers:
        raise ValueError("TF_CONFIG's cluster has no worker or chief: a job needs at least one trainer")
    kind, index = task["type"], task["index"]
    if kind == "ps":
        role, members = PSERVER, pservers
    elif kind in LEADERS or kind == "worker":
        role, members = TRAINER, leaders if kind in LEADERS else trainers[len(leaders) :]
    elif kind == "evaluator":
        raise ValueError(
            "TF_CONFIG's task type is 'evaluator': an evaluator has no role in a parameter-server "
            "job (evaluate on trainer 0 instead)"
        )
    else:
        raise ValueError(f"TF_CONFIG's task type {kind!r} is none of ps, worker, chief, master")
    if not 0 <= index < len(members):
        raise ValueError(
            f"TF_CONFIG's task index {index} is out of range: the cluster has {len(members)} "
            f"{kind!r} replicas"
        )
    check_role(env, role, f"TF_CONFIG's task type {kind!r}")
    check_trainers(env, len(trainers), "TF_CONFIG's cluster (chief and workers)")
    if role == PSERVER:
        return Role(PSERVER, pservers, len(trainers), current_endpoint=pservers[index], source="kubeflow")
    trainer_id = index if kind in LEADERS else len(leaders) + index
    if not pservers and not env.get("MASTER_ADDR"):
        # Collective: trainer 0's address is a rendezvous every replica can reach (its port is free:
        # trainers listen on nothing else).
        host, _, port = trainers[0].rpartition(":")
        env = {**env, "MASTER_ADDR": host, "MASTER_PORT": env.get("MASTER_PORT") or port}
    node = trainer_node(env, pservers, len(trainers), trainer_id, "TF_CONFIG's trainer count")
    return Role(TRAINER, pservers, len(trainers), trainer_id=trainer_id, node=node, source="kubeflow")


def _load(text: str) -> Dict[str, Any]:
    """``TF_CONFIG`` parsed and its shape checked: a cluster of lists and a task of type and index."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ValueError(f"TF_CONFIG is not JSON: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object, got {type(config).__name__}")
    if "cluster" not in config and "sparseCluster" in config:
        raise ValueError(
            "TF_CONFIG has a sparseCluster (the TFJob's enableDynamicWorker): it lists no other "
            "worker, so the trainer count is unknown; turn enableDynamicWorker off"
        )
    cluster, task = config.get("cluster"), config.get("task")
    if not isinstance(cluster, dict):
        raise ValueError('TF_CONFIG has no "cluster" object')
    if not isinstance(task, dict) or not isinstance(task.get("type"), str):
        raise ValueError('TF_CONFIG has no "task" object with a "type"')
    index = task.get("index", 0)
    if isinstance(index, bool) or not isinstance(index, int):
        raise ValueError(f"TF_CONFIG's task index must be an integer, got {index!r}")
    return {"cluster": cluster, "task": {"type": task["type"].lower(), "index": index}}


def _endpoints(cluster: Dict[str, Any], kind: str) -> List[str]:
    """The checked ``host:port`` list of one replica type (empty when the job has none)."""
    members = cluster.get(kind, [])
    if not isinstance(members, list) or not all(isinstance(m, str) for m in members):
        raise ValueError(
            f"TF_CONFIG's cluster[{kind!r}] must be a list of 'host:port' strings, got {members!r}"
        )
    if not members:
        return []
    try:
        return parse_endpoints(members)
    except ValueError as e:
        raise ValueError(f"TF_CONFIG's cluster[{kind!r}]: {e}") from None
