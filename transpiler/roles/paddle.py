"""Paddle's variables, as its launcher and ``ps-launch`` set them (the first and the last source).

=============================== =========================================
``TRAINING_ROLE``               ``PSERVER`` or ``TRAINER``
``PADDLE_PSERVERS_IP_PORT_LIST`` every pserver endpoint, comma-separated
``PADDLE_TRAINERS_NUM``         number of trainers
``PADDLE_TRAINER_ID``           this trainer's id (trainers only)
``POD_IP`` + ``PADDLE_PORT``    this pserver's own endpoint (pservers only)
=============================== =========================================

:func:`explicit` claims an environment that names this process's own place
(``PADDLE_TRAINER_ID`` for a trainer, ``PADDLE_PORT`` for a pserver): it comes
before every engine, so a launcher's explicit roles win. :func:`read` is also the
fallback when ``TRAINING_ROLE`` is set and no engine claimed the environment; its
errors name the Paddle variable that is missing.

A trainer with no ``PADDLE_PSERVERS_IP_PORT_LIST`` (unset or empty) is a collective trainer;
a pserver always needs the list.
"""

from __future__ import annotations

from typing import Mapping, Optional

from .common import PSERVER, TRAINER, NodeEnv, Role, collective_node, get_int, parse_endpoints, training_role

# Every variable a role reads; a launcher sets these and drops inherited ones.
ROLE_VARS = (
    "TRAINING_ROLE",
    "PADDLE_PSERVERS_IP_PORT_LIST",
    "PADDLE_TRAINERS_NUM",
    "PADDLE_TRAINER_ID",
    "POD_IP",
    "PADDLE_PORT",
)


def explicit(env: Mapping[str, str]) -> Optional[Role]:
    """The role when the environment names this process's own place the Paddle way, else None."""
    role = training_role(env)
    own = {TRAINER: "PADDLE_TRAINER_ID", PSERVER: "PADDLE_PORT"}.get(role or "")
    if own is None or not env.get(own, "").strip():
        return None
    return read(env)


def read(env: Mapping[str, str]) -> Optional[Role]:
    """Read the Paddle variables (and a trainer's :class:`NodeEnv`); None when ``TRAINING_ROLE`` is unset.

    Raises ValueError naming the variable that is missing or malformed.
    """
    role = training_role(env)
    if role is None:
        return None

    def need(name: str) -> str:
        value = env.get(name, "")
        if not value.strip():
            raise ValueError(f"{name} is not set; a {role} needs it")
        return value

    def need_int(name: str) -> int:
        need(name)
        return get_int(env, name)

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
        node = (
            collective_node(env, trainers, trainer_id, "PADDLE_TRAINERS_NUM")
            if not pservers
            else NodeEnv.from_env(env)
        )
        return Role(role, pservers, trainers, trainer_id=trainer_id, node=node, source="paddle")
    endpoint = f"{need('POD_IP')}:{need_int('PADDLE_PORT')}"
    # Hot standby: a pserver's backup runs at an endpoint of PS_REPLICA_ENDPOINTS (docs/recovery.md, "Hot
    # standby").
    backups = (
        parse_endpoints(env["PS_REPLICA_ENDPOINTS"]) if env.get("PS_REPLICA_ENDPOINTS", "").strip() else []
    )
    if endpoint not in pservers and endpoint not in backups:
        raise ValueError(
            f"this pserver's endpoint {endpoint} (POD_IP:PADDLE_PORT) is not in "
            f"PADDLE_PSERVERS_IP_PORT_LIST={','.join(pservers)}"
            + (f" nor in PS_REPLICA_ENDPOINTS={','.join(backups)}" if backups else "")
        )
    return Role(role, pservers, trainers, current_endpoint=endpoint, source="paddle")
