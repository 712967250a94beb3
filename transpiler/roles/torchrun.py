"""torchrun's variables, for trainer nodes it starts (the last engine).

torchrun sets ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``RANK``, ``WORLD_SIZE``, ``GROUP_RANK``
(its node's rank) and ``GROUP_WORLD_SIZE`` (the number of nodes). Each torchrun node is one
trainer: its id is ``GROUP_RANK`` (``RANK // LOCAL_WORLD_SIZE`` from launchers that set no
``GROUP_RANK``; torchrun gives every node the same number of processes) and the trainer count
is ``GROUP_WORLD_SIZE`` (``WORLD_SIZE // LOCAL_WORLD_SIZE``). ``PADDLE_TRAINERS_NUM`` or
``PS_TRAINER_NUM``, when set, must agree.

With pservers (``PADDLE_PSERVERS_IP_PORT_LIST``) the node's processes form their own group:
the trainer's ``node`` has ``rank = LOCAL_RANK`` and ``world_size = LOCAL_WORLD_SIZE``. Without,
the trainer is collective and ``RANK``/``WORLD_SIZE`` count every process of the job.

This source claims a process with torchrun's variables (``GROUP_RANK``, or ``RANK`` with
``LOCAL_WORLD_SIZE``) and ``TRAINING_ROLE=TRAINER`` or a pserver list; torchrun never starts
pservers. An engine that starts torchrun (an Indexed Job pod, a Slurm task) comes first: it
names the trainer, torchrun only the node's processes.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .common import TRAINER, Role, check_trainers, explicit_pservers, get_int, trainer_node, training_role


def discover(env: Mapping[str, str]) -> Optional[Role]:
    """This trainer process's role; None when torchrun did not start it, or it is no trainer."""
    if not (
        env.get("GROUP_RANK", "").strip()
        or (env.get("RANK", "").strip() and env.get("LOCAL_WORLD_SIZE", "").strip())
    ):
        return None
    role = training_role(env)
    pservers = explicit_pservers(env)
    if role not in (TRAINER, None) or (role is None and pservers is None):
        return None
    local_world = get_int(env, "LOCAL_WORLD_SIZE", 1, minimum=1)
    local_rank = get_int(env, "LOCAL_RANK", 0, minimum=0)
    rank = get_int(env, "RANK", minimum=0)
    node_rank = get_int(env, "GROUP_RANK", minimum=0)
    if node_rank is None:
        node_rank = rank // local_world
    elif rank is not None and rank != node_rank * local_world + local_rank:
        raise ValueError(
            f"RANK={rank} is not GROUP_RANK={node_rank} x LOCAL_WORLD_SIZE={local_world} + "
            f"LOCAL_RANK={local_rank}"
        )
    nodes = get_int(env, "GROUP_WORLD_SIZE", minimum=1)
    counted = "GROUP_WORLD_SIZE"
    if nodes is None:
        world = get_int(env, "WORLD_SIZE", local_world, minimum=1)
        if world % local_world:
            raise ValueError(f"WORLD_SIZE={world} is not a multiple of LOCAL_WORLD_SIZE={local_world}")
        nodes, counted = world // local_world, "WORLD_SIZE / LOCAL_WORLD_SIZE"
    if node_rank >= nodes:
        raise ValueError(f"this node's rank {node_rank} is out of range [0, {counted}={nodes})")
    check_trainers(env, nodes, f"torchrun's node count ({counted})")
    pservers = pservers or []
    node = trainer_node(env, pservers, nodes, node_rank, "torchrun's node count")
    return Role(TRAINER, pservers, nodes, trainer_id=node_rank, node=node, source="torchrun")
