"""Update engines: when a pushed gradient is applied, who waits for whom, and roll-backs.

- :mod:`.base`: :class:`Engine`, the contract the RPC layer talks to (push,
  wait_updates, read, lookup, roster operations, checkpoint and roll-back) and
  what both engines share; :mod:`.sync` (:class:`SyncEngine`, the barrier) and
  :mod:`.asynchronous` (:class:`AsyncEngine`, apply on arrival) implement it.
- :mod:`.contents`: what the engine holds as requests name it (block names and
  layout, what a push or prefetch may carry, how a push splits; a mixin of :class:`Engine`).
- :mod:`.rollback`: checkpoints, resume and roll-back (a mixin of :class:`Engine`).
- :mod:`.roster`: the trainers as one pserver sees them; :mod:`.snapshot`: the
  state Stats and /metrics report.
- :mod:`.reductions`: :class:`Reductions`, the Reduce service (trainers' global
  metrics), with its own lock; it asks the engine which trainers it expects.

Pure of gRPC: refusals are :mod:`pserver.errors`, mapped to statuses by :mod:`pserver.rpc`.
"""
from .asynchronous import AsyncEngine
from .base import Engine, Joined
from .contents import PushParts
from .reductions import Reductions
from .snapshot import Snapshot
from .sync import SyncEngine

__all__ = ["Engine", "Joined", "SyncEngine", "AsyncEngine", "PushParts", "Reductions", "Snapshot"]
