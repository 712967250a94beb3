"""The backup as its primary sees it: its states, the messages kept for it, and how they reach it.

The :class:`~.outbox.Outbox` holds at most one :class:`Backup` and changes it by its methods. The backup's
states, and what a wait needs:

==========================  ============================================  ==============================
backup                      what the sender does                          a trainer's call waits for
==========================  ============================================  ==============================
none                        nothing (messages are not even encoded)       nothing
copying the snapshot        keeps the messages since the snapshot         nothing (not counted yet)
catching up                 sends them                                    nothing (not counted yet)
counted (a message behind)  sends each as it comes                        the backup's acknowledgement
in sync (in etcd's list)    sends each as it comes                        the backup's acknowledgement
==========================  ============================================  ==============================

Waits start counting on a catching-up backup when one message at most is left for it (so catching up never
stalls training), and it enters the shard's in-sync list in etcd only once it holds every message.

Each change travels as ReplicaChunk messages (:func:`encode_update`), sent by a :class:`Transport`
(implemented over gRPC by :mod:`pserver.rpc.replica_link`).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Deque, List, Mapping, Tuple

import torch

from psproto import ps_pb2
from psproto.codec import encode_chunks


@dataclass
class Backup:
    """The shard's other process as its primary sees it; the outbox changes it under its lock, by these
    methods."""

    replica_id: str
    endpoint: str
    following: bool = False  # loaded the snapshot and asked for the messages since
    counted: bool = False  # waits count on it: nothing more is acknowledged without it
    in_sync: bool = False  # in etcd's in-sync list: it may lead if this process is lost
    queue: Deque[Tuple[int, List[bytes]]] = field(default_factory=collections.deque)
    queued_bytes: int = 0

    def queue_message(self, seq: int, messages: List[bytes]) -> None:
        """Keep message ``seq`` (its encoded parts) until the backup takes it."""
        self.queue.append((seq, messages))
        self.queued_bytes += sum(len(m) for m in messages)

    def took_first(self) -> None:
        """The backup acknowledged the first queued message: it leaves the queue."""
        _, messages = self.queue.popleft()
        self.queued_bytes -= sum(len(m) for m in messages)

    def follows(self) -> None:
        """It loaded the snapshot and asks for the messages since; nearly caught up already, it counts."""
        self.following = True
        self.count_if_caught_up()

    def count_if_caught_up(self) -> None:
        """Count it from the next message on once one message at most is left for it."""
        if len(self.queue) <= 1:
            self.counted = True

    def now_in_sync(self) -> None:
        """It entered etcd's in-sync list."""
        self.in_sync = True


def encode_update(
    epoch: int,
    seq: int,
    lr_step: int,
    pserver_step: int,
    roster: str,
    digest: str,
    dense: Mapping[str, torch.Tensor],
    sparse: Mapping,
    chunk_bytes: int,
) -> List[bytes]:
    """One change as ReplicaChunk messages: the header, the dense gradients, each table's ids and rows."""
    header = ps_pb2.ReplicaHeader(
        epoch=epoch, seq=seq, step=pserver_step, lr_step=lr_step, roster=roster, digest=digest
    )
    tensors = list(dense.items())
    for name, (ids, rows) in sparse.items():
        tensors.append((f"{name}@ids", torch.as_tensor(ids)))
        tensors.append((f"{name}@rows", rows))
    return list(encode_chunks(header, tensors, chunk_bytes))


class ReplicaUnreachable(Exception):
    """The backup did not take a message (down, refused it, or out of sync); the message names why."""


class Transport:
    """How a primary reaches its backup: one method, implemented over gRPC by
    :mod:`pserver.rpc.replica_link`."""

    def send(
        self, endpoint: str, messages: List[bytes], timeout: float
    ) -> int:  # pragma: no cover - interface
        """Send one update's messages (a header first, then pieces) to ``endpoint``; the seq it
        acknowledged."""
        raise NotImplementedError

    def reconnect(self, endpoint: str) -> None:
        """A new process at ``endpoint``: forget the connection to the old one (and its reconnect backoff)."""
