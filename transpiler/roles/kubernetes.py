"""Kubernetes pods: pservers in a StatefulSet behind a headless Service, trainers in an Indexed Job.

=========================== ===================================================================
``PS_PSERVER_SERVICE``      the headless Service's name, optionally namespace-qualified
                            (``ps-pserver``, ``ps-pserver.team-a``, or a full domain name)
``PS_PSERVER_NUM``          number of pservers (the StatefulSet's replicas)
``PS_PSERVER_PORT``         their port (default 6170)
``PS_PSERVER_STATEFULSET``  the StatefulSet's name (pservers: default from ``HOSTNAME``;
                            trainers must set it)
``PS_TRAINER_NUM``          number of trainers (or ``PADDLE_TRAINERS_NUM``)
``HOSTNAME``                set by Kubernetes: ``<statefulset>-<ordinal>`` in a StatefulSet,
                            ``<job>-<index>`` in an Indexed Job
``JOB_COMPLETION_INDEX``    set by Kubernetes in an Indexed Job's pods: the trainer id
=========================== ===================================================================

Pserver ``i`` is ``<statefulset>-<i>.<service>:<port>``; a pserver is the one whose
``HOSTNAME`` ordinal is ``i``. With hot standby (``PS_SERVER_REPLICAS=2``, docs/recovery.md, "Hot standby")
the StatefulSet runs twice ``PS_PSERVER_NUM`` pods: pod ``N + i`` is pserver ``i``'s backup
(:func:`replica_endpoints`). ``PADDLE_PSERVERS_IP_PORT_LIST`` may give the list instead of
the Service (with both, they must agree). The role is ``TRAINING_ROLE`` when set; otherwise a
pod with ``JOB_COMPLETION_INDEX`` is a trainer and any other a pserver. A pserver pod may also
run in an Indexed Job (``JOB_COMPLETION_INDEX`` is then its ordinal).

This source claims a pod with ``PS_PSERVER_SERVICE`` or ``PS_PSERVER_STATEFULSET`` set, or with
``JOB_COMPLETION_INDEX`` and ``TRAINING_ROLE`` (or ``PADDLE_PSERVERS_IP_PORT_LIST``) set.
"""

from __future__ import annotations

import re
from typing import List, Mapping, Optional, Tuple

from .common import (
    DEFAULT_PSERVER_PORT,
    PSERVER,
    TRAINER,
    Role,
    explicit_pservers,
    get_int,
    get_port,
    given_trainers,
    trainer_node,
    training_role,
)

SERVICE, NUM, PORT, STATEFULSET = (
    "PS_PSERVER_SERVICE",
    "PS_PSERVER_NUM",
    "PS_PSERVER_PORT",
    "PS_PSERVER_STATEFULSET",
)
INDEX = "JOB_COMPLETION_INDEX"
_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_DNS_NAME = re.compile(rf"^{_LABEL}(\.{_LABEL})*$")
_POD_ORDINAL = re.compile(r"^(?P<name>.+)-(?P<ordinal>\d+)$")


def discover(env: Mapping[str, str]) -> Optional[Role]:
    """This pod's role; None when none of the variables above is set."""
    has = {name: bool(env.get(name, "").strip()) for name in (SERVICE, STATEFULSET, INDEX, "TRAINING_ROLE")}
    indexed = has[INDEX] and (has["TRAINING_ROLE"] or explicit_pservers(env) is not None)
    if not (has[SERVICE] or has[STATEFULSET] or indexed):
        return None
    role = training_role(env) or (TRAINER if has[INDEX] else PSERVER)
    trainers = given_trainers(env)
    if trainers is None:
        raise ValueError(
            f"PS_TRAINER_NUM is not set; a Kubernetes {role} needs the number of trainers "
            f"(or PADDLE_TRAINERS_NUM)"
        )
    return _pserver(env, trainers) if role == PSERVER else _trainer(env, trainers)


def service_endpoints(service: str, statefulset: str, pservers: int, port: int) -> List[str]:
    """The stable endpoints of a StatefulSet's pods behind a headless Service:
    ``<sts>-<i>.<service>:<port>``."""
    return [f"{statefulset}-{i}.{service}:{port}" for i in range(pservers)]


def _pserver(env: Mapping[str, str], trainers: int) -> Role:
    statefulset, ordinal = _pod_ordinal(env)
    pservers = _pservers(env, statefulset)
    if not pservers:
        raise ValueError(
            "a PSERVER pod needs the pserver list: set PS_PSERVER_SERVICE and PS_PSERVER_NUM "
            "(or PADDLE_PSERVERS_IP_PORT_LIST)"
        )
    processes = pservers + (replica_endpoints(env, statefulset) or [])
    service = env.get(SERVICE, "").strip()
    if (
        ordinal >= len(processes)
        and service
        and explicit_pservers(env) is None
        and len(processes) == len(pservers)
    ):
        # A pod the StatefulSet was scaled up to: the job's list grown to it. It waits for the change of
        # pserver count that adds it (ps-reshard, docs/operations.md) before it serves.
        port = get_port(env, PORT, DEFAULT_PSERVER_PORT)
        grown = service_endpoints(service, env.get(STATEFULSET, "").strip() or statefulset, ordinal + 1, port)
        return Role(PSERVER, grown, trainers, current_endpoint=grown[ordinal], source="kubernetes")
    if ordinal >= len(processes):
        raise ValueError(
            f"this pod is pserver {ordinal} (HOSTNAME={env.get('HOSTNAME')}) but the job has "
            f"{len(processes)} pserver processes ({NUM}={env.get(NUM)}, {REPLICAS}="
            f"{env.get(REPLICAS, '1')}): scale the StatefulSet to {NUM} x {REPLICAS}"
        )
    return Role(PSERVER, pservers, trainers, current_endpoint=processes[ordinal], source="kubernetes")


REPLICAS = "PS_SERVER_REPLICAS"


def replica_endpoints(env: Mapping[str, str], statefulset: Optional[str] = None) -> Optional[List[str]]:
    """Hot standby in one StatefulSet: pods ``N .. 2N-1`` back up pservers ``0 .. N-1``; None unless
    replicated.

    Only with ``PS_PSERVER_SERVICE`` and ``PS_SERVER_REPLICAS=2`` (trainers also need
    ``PS_PSERVER_STATEFULSET``, as for the pserver list).
    """
    service = env.get(SERVICE, "").strip()
    if not service or env.get(REPLICAS, "").strip() != "2":
        return None
    num = get_int(env, NUM, minimum=1)
    name = env.get(STATEFULSET, "").strip() or statefulset
    if (
        not name
    ):  # a pserver pod: its own StatefulSet, from HOSTNAME (trainers must set PS_PSERVER_STATEFULSET)
        match = _POD_ORDINAL.match(env.get("HOSTNAME", "").strip())
        name = match["name"] if match else None
    if num is None or not name:
        return None
    return service_endpoints(service, name, 2 * num, get_port(env, PORT, DEFAULT_PSERVER_PORT))[num:]


def _trainer(env: Mapping[str, str], trainers: int) -> Role:
    trainer_id = get_int(env, INDEX, minimum=0)
    if trainer_id is None:
        raise ValueError(
            f"{INDEX} is not set: run trainers as an Indexed Job (completionMode: Indexed) "
            f"or set PADDLE_TRAINER_ID"
        )
    if trainer_id >= trainers:
        raise ValueError(
            f"{INDEX}={trainer_id} is out of range [0, PS_TRAINER_NUM={trainers}): the Job's "
            f"completions and PS_TRAINER_NUM must agree"
        )
    pservers = _pservers(env, None)
    node = trainer_node(env, pservers, trainers, trainer_id, "PS_TRAINER_NUM")
    return Role(TRAINER, pservers, trainers, trainer_id=trainer_id, node=node, source="kubernetes")


def _pod_ordinal(env: Mapping[str, str]) -> Tuple[str, int]:
    """(the name of this pserver pod's StatefulSet or Job, its ordinal) from
    ``HOSTNAME``/``JOB_COMPLETION_INDEX``."""
    hostname = env.get("HOSTNAME", "").strip()
    statefulset = env.get(STATEFULSET, "").strip() or None
    match = _POD_ORDINAL.match(hostname)
    if statefulset is not None and match is not None and match["name"] != statefulset:
        match = None
    index = get_int(env, INDEX, minimum=0)
    if index is not None:
        if match is not None and int(match["ordinal"]) != index:
            raise ValueError(f"HOSTNAME={hostname} and {INDEX}={index} name different pservers")
        return statefulset or (match["name"] if match else ""), index
    if match is None:
        want = f"{statefulset}-<ordinal>" if statefulset else "<statefulset>-<ordinal>"
        raise ValueError(
            f"HOSTNAME={hostname!r} is not a StatefulSet pod's name {want}; a pserver pod needs "
            f"one (a trainer pod: set TRAINING_ROLE=TRAINER and run it in an Indexed Job)"
        )
    return match["name"], int(match["ordinal"])


def _pservers(env: Mapping[str, str], statefulset: Optional[str]) -> List[str]:
    """The pserver list from the Service variables, or ``PADDLE_PSERVERS_IP_PORT_LIST``; [] when neither."""
    explicit = explicit_pservers(env)
    service = env.get(SERVICE, "").strip()
    if not service:
        return explicit or []
    _check_dns_name(SERVICE, service)
    num = get_int(env, NUM, minimum=1)
    if num is None:
        raise ValueError(f"{NUM} is not set; with {SERVICE} it says how many pservers the StatefulSet runs")
    port = get_port(env, PORT, DEFAULT_PSERVER_PORT)
    name = env.get(STATEFULSET, "").strip() or statefulset
    if not name:
        raise ValueError(
            f"{STATEFULSET} is not set; only a pserver pod's HOSTNAME (<statefulset>-<ordinal>) "
            f"names the pserver StatefulSet, so trainer pods must set it"
        )
    _check_dns_name(STATEFULSET if env.get(STATEFULSET, "").strip() else "HOSTNAME", name)
    derived = service_endpoints(service, name, num, port)
    if explicit is not None and explicit != derived:
        raise ValueError(
            f"PADDLE_PSERVERS_IP_PORT_LIST={','.join(explicit)} contradicts {SERVICE}/{NUM}/"
            f"{PORT}/{STATEFULSET}, which give {','.join(derived)}; set one"
        )
    return derived


def _check_dns_name(variable: str, name: str) -> None:
    if len(name) > 253 or not _DNS_NAME.match(name):
        raise ValueError(f"{variable}={name!r} is not a DNS name (lower-case letters, digits, '-' and '.')")
