"""Where a trainer node's local processes meet to form their process group (a pure decision).

With pservers every node is one trainer and its processes form a group of their own
(``rank = LOCAL_RANK``, ``world_size = LOCAL_WORLD_SIZE``). Where that group meets depends
on who set ``MASTER_ADDR:MASTER_PORT``:

- ``ps-launch --nproc_per_node``, a per-host ``torchrun --standalone``, or a script's own
  ``init_method``: an address of the node's own. Local rank 0 hosts the store there
  (``tcp://`` rendezvous), as before.
- a torchrun (or any launcher) across nodes: ``WORLD_SIZE`` counts every process of the job,
  more than ``LOCAL_WORLD_SIZE``, and ``MASTER_ADDR:MASTER_PORT`` is one store for the whole
  job. Every node would write the same keys there (rank 0 of each colliding), so each joins
  through its own key prefix, ``pserver_trainer_node<trainer id>/restart<TORCHELASTIC_RESTART_COUNT>``
  (a restarted node's group never reads the keys of its last attempt). Who hosts that store:
  torchrun's agent on node rank 0 when ``TORCHELASTIC_USE_AGENT_STORE=True`` (torchrun sets
  it for the static rendezvous, ``--master-addr``, and for c10d's shared store, the default);
  otherwise (c10d with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, or a launcher of one's own)
  the job's ``RANK`` 0, as ``torch.distributed``'s ``env://`` does.

``WORLD_SIZE`` alone says whether the store is job-wide: ps-launch sets it to the local size
for every node (dropping the one it inherited), so torchrun variables a launcher leaks
(``GROUP_WORLD_SIZE``, ``TORCHELASTIC_USE_AGENT_STORE``) do not turn its per-node groups
into clients of a store nobody hosts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from transpiler.roles.common import get_int, get_port

AGENT_STORE_VAR = "TORCHELASTIC_USE_AGENT_STORE"
RESTART_VAR = "TORCHELASTIC_RESTART_COUNT"


@dataclass(frozen=True)
class SharedStore:
    """A store the whole job shares; the node's group keeps its keys under ``prefix``.

    ``is_master``: this process hosts the store (a ``TCPStore`` server); else it connects to it.
    """

    host: str
    port: int
    prefix: str
    is_master: bool

    def describe(self) -> str:
        host = "hosting" if self.is_master else "through"
        return f"{host} the job's store at {self.host}:{self.port} under prefix {self.prefix!r}"


@dataclass(frozen=True)
class NodeRendezvous:
    """Where the node's processes meet: ``init_method`` (an address of their own) or ``store`` (shared).

    Both None when nothing says where (``join_group`` then asks for ``MASTER_ADDR``/``MASTER_PORT``).
    """

    init_method: Optional[str] = None
    store: Optional[SharedStore] = None

    def describe(self) -> str:
        if self.store is not None:
            return self.store.describe()
        return f"at {self.init_method}"


def node_prefix(trainer_id: int, restart: int) -> str:
    """The store prefix of trainer node ``trainer_id``'s group in attempt ``restart`` of the job's
    processes."""
    return f"pserver_trainer_node{trainer_id}/restart{restart}"


def node_rendezvous(
    env: Mapping[str, str], trainer_id: int, local_world_size: int, init_method: Optional[str] = None
) -> NodeRendezvous:
    """Where the ``local_world_size`` processes of trainer node ``trainer_id`` meet, from ``env``.

    ``init_method`` (given to the Trainer) wins. Else a ``WORLD_SIZE`` above the node's
    size means ``MASTER_ADDR:MASTER_PORT`` is the job's store: the node joins it under its
    prefix, hosting it only when no torchrun agent does and this is the job's ``RANK`` 0.
    Else the node's own ``tcp://MASTER_ADDR:MASTER_PORT`` (None when unset). Raises
    ValueError naming the variable missing or malformed.
    """
    if init_method:
        return NodeRendezvous(init_method=init_method)
    addr = env.get("MASTER_ADDR", "").strip() or None
    port = get_port(env, "MASTER_PORT", 0) if env.get("MASTER_PORT", "").strip() else None
    world = get_int(env, "WORLD_SIZE", local_world_size, minimum=1)
    if world <= local_world_size:
        return NodeRendezvous(init_method=f"tcp://{addr}:{port}" if addr and port else None)
    missing = [name for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not value]
    if missing:
        raise ValueError(
            f"trainer node {trainer_id}: WORLD_SIZE={world} counts the processes of several nodes, "
            f"whose store is at MASTER_ADDR:MASTER_PORT, but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} unset"
        )
    restart = get_int(env, RESTART_VAR, 0, minimum=0)
    agent = env.get(AGENT_STORE_VAR, "").strip() == "True"  # torch's own test: == str(True)
    if agent:
        is_master = False
    else:
        rank = get_int(env, "RANK", minimum=0)
        if rank is None:
            raise ValueError(
                f"trainer node {trainer_id}: WORLD_SIZE={world} counts the processes of several "
                f"nodes and no torchrun agent hosts the store at {addr}:{port} ({AGENT_STORE_VAR} "
                f"is not True), so the job's RANK 0 must host it: set RANK (the job-wide rank)"
            )
        is_master = rank == 0
    return NodeRendezvous(store=SharedStore(addr, port, node_prefix(trainer_id, restart), is_master))
