"""Slurm tasks: the first ``PS_PSERVER_NUM`` tasks of a step are pservers, the rest trainers.

=============================== ===============================================================
``SLURM_PROCID``                this task's rank in the step
``SLURM_NTASKS``                tasks in the step (``SLURM_STEP_NUM_TASKS`` preferred when set)
``SLURM_STEP_NODELIST``         the step's nodes, compressed (falls back to ``SLURM_JOB_NODELIST``)
``SLURM_STEP_TASKS_PER_NODE``   tasks on each of them, ``"2(x3),1"`` (falls back to
                                ``SLURM_TASKS_PER_NODE``)
``SLURMD_NODENAME``,            checked: this pserver runs where the block layout puts it
``SLURM_LOCALID``
``PS_PSERVER_NUM``              K, the number of pservers (0: every task is a collective trainer)
``PS_PSERVER_PORT``             the first pserver port on a node (default 6170); the pserver in
                                slot s of a node listens on ``PS_PSERVER_PORT + s``
``PS_SLURM_HOST_SUFFIX``        appended to node names to make pserver host names (e.g. ``-ib``)
=============================== ===============================================================

Hot standby (``PS_SERVER_REPLICAS=2``, docs/recovery.md, "Hot standby"): the first ``2K`` tasks are pserver
processes, task ``K + i`` pserver ``i``'s backup (:func:`replica_endpoints`), and trainer ``t``
is task ``2K + t``. Homogeneous steps only.

Tasks are placed by Slurm's default block distribution (``-m block``): node 0 of the node
list runs tasks ``0..n0-1``, node 1 the next ``n1``, ... So pserver ``i`` (task ``i < K``) is
``<its node>:<PS_PSERVER_PORT + its slot on the node>`` and trainer ``t`` is task ``K + t``.

**Heterogeneous jobs** (``SLURM_HET_SIZE`` >= 2): component 0's tasks are the pservers,
component 1's the trainers, each laid out from ``SLURM_JOB_NODELIST_HET_GROUP_<c>`` and
``SLURM_TASKS_PER_NODE_HET_GROUP_<c>``. One ``srun`` over both components
(``srun --het-group=0,1`` or ``srun A : B``) numbers tasks across them (``SLURM_PROCID`` is
global and ``SLURM_NTASKS`` their sum); with one ``srun`` per component, ``SLURM_PROCID`` counts
within it, and ``TRAINING_ROLE`` must say which component this is.

This source claims a task with ``SLURM_PROCID`` and either ``PS_PSERVER_NUM`` or
``SLURM_HET_SIZE`` >= 2 set.
"""

from __future__ import annotations

from typing import List, Mapping, Optional, Tuple

from .common import (
    DEFAULT_PSERVER_PORT,
    PSERVER,
    TRAINER,
    Role,
    check_role,
    check_trainers,
    get_int,
    get_port,
    trainer_node,
    training_role,
)
from .slurm_lists import block_layout, expand_nodelist, tasks_per_node

NUM, PORT, SUFFIX = "PS_PSERVER_NUM", "PS_PSERVER_PORT", "PS_SLURM_HOST_SUFFIX"
Layout = List[Tuple[str, int]]  # (node, slot on it) of every task


def discover(env: Mapping[str, str]) -> Optional[Role]:
    """This task's role; None outside a Slurm step or without ``PS_PSERVER_NUM``/a heterogeneous job."""
    het = get_int(env, "SLURM_HET_SIZE", 0)
    if not env.get("SLURM_PROCID", "").strip() or not (env.get(NUM, "").strip() or het >= 2):
        return None
    procid = get_int(env, "SLURM_PROCID", minimum=0)
    if het >= 2:
        return _heterogeneous(env, procid)
    return _homogeneous(env, procid)


def _homogeneous(env: Mapping[str, str], procid: int) -> Role:
    nodes_var = _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST")
    tasks_var = _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE")
    layout = _layout(env, nodes_var, tasks_var)
    ntasks_var = _first_set(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
    ntasks = get_int(env, ntasks_var, len(layout), minimum=1)
    if ntasks != len(layout):
        raise ValueError(f"{ntasks_var}={ntasks} but {tasks_var}={env[tasks_var]} places {len(layout)} tasks")
    if procid >= ntasks:
        raise ValueError(f"SLURM_PROCID={procid} is out of range [0, {ntasks_var}={ntasks})")
    k = get_int(env, NUM, minimum=0)
    servers = k * _replicas(env)
    times = f" x {REPLICAS}={_replicas(env)}" if _replicas(env) > 1 else ""
    if servers >= ntasks:
        raise ValueError(f"{NUM}={k}{times} leaves no trainer among the step's {ntasks} tasks ({ntasks_var})")
    pservers = _endpoints(env, layout[:k])
    if procid < servers:
        check_role(env, PSERVER, f"SLURM_PROCID={procid} < {NUM}={k}{times}")
        _check_placement(env, layout[procid], procid, check_slot=True)
        return Role(
            PSERVER,
            pservers,
            ntasks - servers,
            current_endpoint=_endpoints(env, layout[:servers])[procid],
            source="slurm",
        )
    check_role(env, TRAINER, f"SLURM_PROCID={procid} >= {NUM}={k}{times}")
    return _trainer(env, pservers, ntasks - servers, procid - servers, f"{ntasks_var} - {NUM}")


REPLICAS = "PS_SERVER_REPLICAS"


def _replicas(env: Mapping[str, str]) -> int:
    return 2 if env.get(REPLICAS, "").strip() == "2" else 1


def replica_endpoints(env: Mapping[str, str]) -> Optional[List[str]]:
    """Hot standby in one homogeneous step: tasks ``K .. 2K-1`` back up pservers ``0 .. K-1``; None
    otherwise."""
    if (
        not env.get("SLURM_PROCID", "").strip()
        or _replicas(env) != 2
        or get_int(env, "SLURM_HET_SIZE", 0) >= 2
    ):
        return None
    k = get_int(env, NUM, minimum=0)
    if not k:
        return None
    layout = _layout(
        env,
        _first_set(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST"),
        _first_set(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
    )
    return _endpoints(env, layout[: 2 * k])[k:]


def _heterogeneous(env: Mapping[str, str], procid: int) -> Role:
    pserver_layout = _layout(env, "SLURM_JOB_NODELIST_HET_GROUP_0", "SLURM_TASKS_PER_NODE_HET_GROUP_0")
    trainer_layout = _layout(env, "SLURM_JOB_NODELIST_HET_GROUP_1", "SLURM_TASKS_PER_NODE_HET_GROUP_1")
    k, trainers = len(pserver_layout), len(trainer_layout)
    given = get_int(env, NUM, minimum=0)
    if given is not None and given != k:
        raise ValueError(
            f"{NUM}={given} contradicts the heterogeneous job's component 0, which runs {k} "
            f"pserver tasks (SLURM_TASKS_PER_NODE_HET_GROUP_0)"
        )
    ntasks = get_int(env, "SLURM_NTASKS", minimum=1)
    if ntasks is None:
        raise ValueError("SLURM_NTASKS is not set; a Slurm task's role needs it")
    if procid >= ntasks:
        raise ValueError(f"SLURM_PROCID={procid} is out of range [0, SLURM_NTASKS={ntasks})")
    role = training_role(env)
    if ntasks == k + trainers:  # one srun over both components: global task ids, pservers first
        spans_both, index = True, procid if procid < k else procid - k
        derived = PSERVER if procid < k else TRAINER
        check_role(
            env, derived, f"SLURM_PROCID={procid} in a step over both components ({k} pserver tasks first)"
        )
        role = derived
    elif role is None:
        raise ValueError(
            f"SLURM_NTASKS={ntasks} is not the {k} + {trainers} tasks of components 0 and 1: with "
            f"one srun per component, set TRAINING_ROLE (PSERVER in component 0, TRAINER in 1)"
        )
    else:
        spans_both, index = False, procid
        own = k if role == PSERVER else trainers
        if ntasks != own:
            raise ValueError(
                f"SLURM_NTASKS={ntasks}: a {role} step must run all {own} tasks of component "
                f"{0 if role == PSERVER else 1}"
            )
    pservers = _endpoints(env, pserver_layout)
    if role == PSERVER:
        # Task ids on a node are the step's: only a step of component 0 alone numbers them like its layout.
        _check_placement(env, pserver_layout[index], procid, check_slot=not spans_both)
        return Role(PSERVER, pservers, trainers, current_endpoint=pservers[index], source="slurm")
    return _trainer(env, pservers, trainers, index, "component 1's tasks (SLURM_TASKS_PER_NODE_HET_GROUP_1)")


def _trainer(
    env: Mapping[str, str], pservers: List[str], trainers: int, trainer_id: int, counted: str
) -> Role:
    check_trainers(env, trainers, f"the Slurm step ({counted})")
    node = trainer_node(env, pservers, trainers, trainer_id, "the Slurm trainer count")
    return Role(TRAINER, pservers, trainers, trainer_id=trainer_id, node=node, source="slurm")


def _layout(env: Mapping[str, str], nodes_var: str, tasks_var: str) -> Layout:
    for name in (nodes_var, tasks_var):
        if not env.get(name, "").strip():
            raise ValueError(f"{name} is not set; a Slurm task's role needs it")
    nodes = expand_nodelist(env[nodes_var], nodes_var)
    counts = tasks_per_node(env[tasks_var], tasks_var)
    if len(nodes) != len(counts):
        raise ValueError(
            f"{nodes_var}={env[nodes_var]} names {len(nodes)} nodes but {tasks_var}="
            f"{env[tasks_var]} gives tasks for {len(counts)}"
        )
    return block_layout(nodes, counts)


def _endpoints(env: Mapping[str, str], pserver_tasks: Layout) -> List[str]:
    """Pserver ``i``'s endpoint: its node's name (plus ``PS_SLURM_HOST_SUFFIX``) and the port of its slot."""
    port = get_port(env, PORT, DEFAULT_PSERVER_PORT)
    suffix = env.get(SUFFIX, "").strip()
    last = port + max((slot for _, slot in pserver_tasks), default=0)
    if last > 65535:
        raise ValueError(f"{PORT}={port} + {last - port} pservers on one node runs past port 65535")
    return [f"{node}{suffix}:{port + slot}" for node, slot in pserver_tasks]


def _check_placement(env: Mapping[str, str], placed: Tuple[str, int], procid: int, check_slot: bool) -> None:
    """A pserver must run where its endpoint says: Slurm's block distribution, not cyclic or plane."""
    node, slot = placed
    here = env.get("SLURMD_NODENAME", "").strip()
    if here and here != node:
        raise ValueError(
            f"SLURMD_NODENAME={here}, but the block layout puts task {procid} on {node}: launch "
            f"with the default block distribution (srun -m block)"
        )
    local = get_int(env, "SLURM_LOCALID", minimum=0)
    if check_slot and local is not None and local != slot:
        raise ValueError(
            f"SLURM_LOCALID={local}, but the block layout makes task {procid} number {slot} on "
            f"{node}: launch with the default block distribution (srun -m block)"
        )


def _first_set(env: Mapping[str, str], preferred: str, fallback: str) -> str:
    return preferred if env.get(preferred, "").strip() else fallback
