"""Which replica of a pserver shard is its primary: leases and fencing epochs in etcd.

Each shard ``k`` of a job has two replica processes; etcd (keys under ``PREFIX/shard-k``) decides
which one leads. ``primary`` names the leader and lives on its lease, so it vanishes when the
leader dies; its create revision is the leader's *epoch*, strictly increasing across takeovers,
the token every message of the primary carries so that a deposed one is refused. ``in_sync``
lists the replicas holding every acknowledged update; it is on no lease because it must outlive
them all: only a listed replica may take over without losing updates (or one told to, ``force``).

This module is the interface (:class:`Coordinator`) and its records; :mod:`.etcd` implements it
over etcd's HTTP gateway. Nothing here knows gRPC: failures are :class:`CoordinationError`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Tuple


@dataclass(frozen=True)
class Leader:
    """What ``shard-k/primary`` says; ``epoch`` is the key's create revision."""

    endpoint: str
    replica_id: str
    epoch: int


@dataclass(frozen=True)
class InSync:
    """What ``shard-k/in_sync`` says; ``revision`` is the key's mod revision (for compare-and-swap)."""

    replicas: Tuple[str, ...]
    endpoints: Mapping[str, str] = field(hash=False)
    epoch: int
    lineage: str
    revision: int


class CoordinationError(Exception):
    """etcd could not be reached or answered an error; the message names the endpoint and the operation."""


def may_campaign(in_sync: Optional[InSync], replica_id: str, force: bool) -> bool:
    """Whether ``replica_id`` may try to lead: the shard is fresh (no in-sync list), it is listed, or
    ``force``.

    A replica missing from the list may lack acknowledged updates; leading would lose them, which only an
    explicit ``force`` (recovery from a checkpoint, under a new lineage) accepts.
    """
    return in_sync is None or force or replica_id in in_sync.replicas


def shards_prefix(program) -> str:
    """Where the keys of ``program``'s shards live: the job's ``coordinator_prefix`` (by default one per
    plan), and a layout's own under it once its job changed its pserver count (each layout's shards are new
    ones: their leads and in-sync lists start anew)."""
    cfg = program.config
    prefix = (cfg.coordinator_prefix or f"/torch-pserver/{program.layout_digest}").rstrip("/")
    return f"{prefix}/layout-{program.layout_epoch}" if program.layout_epoch else prefix


class Coordinator(ABC):
    """One replica process's view of its shard in the coordination service."""

    @property
    @abstractmethod
    def replica_id(self) -> str:
        """This process's replica id (random per process: a restarted process is a new replica)."""

    @abstractmethod
    def leader(self) -> Optional[Leader]:
        """The shard's primary as etcd records it now, or None when it has none (one linearizable read)."""

    @abstractmethod
    def in_sync(self) -> Optional[InSync]:
        """The shard's in-sync list as etcd records it now, or None when the key is absent (a fresh shard)."""

    @abstractmethod
    def campaign(self, endpoint: str, lineage: str, force: bool = False) -> Optional[int]:
        """Become the primary at ``endpoint`` if no replica leads and :func:`may_campaign` allows; return
        the new epoch, or None when another replica leads or the conditions fail. The decision is one etcd
        transaction (no primary key, in-sync list unchanged since read), so of replicas campaigning at once
        at most one wins. The primary key lives on this process's lease (granted here, then kept alive);
        the in-sync list becomes this replica alone at the new epoch, keeping the stored lineage unless
        ``force`` or the shard is fresh."""

    @abstractmethod
    def set_in_sync(self, epoch: int, replicas: Mapping[str, str]) -> bool:
        """As the primary at ``epoch``, replace the in-sync list by ``replicas`` ({replica_id: endpoint}),
        keeping the lineage: one transaction, applied only while the primary key's create revision is still
        ``epoch``. False means this process no longer leads at ``epoch`` and must fence itself."""

    @abstractmethod
    def holds(self, epoch: int) -> bool:
        """Whether this process certainly still leads at ``epoch``: local, no I/O, cheap enough for every
        request. True while the lease's last successful keep-alive was *sent* less than ``ttl - ttl/4``
        seconds ago (etcd cannot have expired it earlier). A keep-alive answering that the lease expired
        makes it False at once, failing keep-alives at that deadline; either way ``on_lost(epoch)`` is
        called once."""

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change()`` (from another thread) whenever the shard's records change; a new call
        replaces it.

        A hint that saves polling: the caller still reads :meth:`leader` and :meth:`in_sync` itself, and
        re-reads them now and then in case a change went unreported (the watch's connection lost). The
        default reports nothing.
        """

    @abstractmethod
    def resign(self) -> None:
        """Step down gracefully: revoke the lease, so the primary key vanishes at once and a backup takes over
        without waiting for the TTL. Never raises (a failure is logged; the lease then expires)."""

    @abstractmethod
    def close(self) -> None:
        """Stop the keep-alive thread and release the HTTP sessions; never raises. Does not revoke the lease:
        call :meth:`resign` first for a prompt hand-over."""
