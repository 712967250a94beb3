"""Update engines: when a pushed gradient is applied, who waits for whom, and roll-backs.

- :mod:`.engine`: :class:`Engine`, the contract the RPC layer talks to (push,
  wait_for_step, read, lookup, roster operations, checkpoint and roll-back,
  the backup's side of hot standby), composed of parts handed to its
  constructor, over what every mode shares; :class:`SyncEngine` and
  :class:`AsyncEngine` name an engine of one mode.
- :mod:`.modes`: what each mode decides about a push, one handler per mode
  that the engine calls for every push (ps-lite's request handle), chosen
  from the plan (:func:`~.modes.for_plan`): :mod:`.modes.mode` (the interface,
  :class:`~.modes.mode.Mode`), :mod:`.modes.sync` (the barrier),
  :mod:`.modes.backup_steps` (backup trainers' step sets and dropped pushes),
  :mod:`.modes.asynchronous` (apply on arrival, ``max_staleness``) and
  :mod:`.modes.geo_deltas` (GEO's scaled deltas).
- :mod:`.listeners`: :class:`UpdateListener`, told of every change under the
  engine's lock, and its implementations: replication, scheduled checkpoints,
  scheduled exports (and :class:`FileWrites`, the switch a backup keeps off).
- :mod:`.pending`: :class:`PendingStep`, the sync mode's step in progress.
- :mod:`.rollback`: :class:`RollBacks`, the engine's checkpoints on demand,
  resume and roll-backs once per token (the state reset to a checkpoint, or
  to a primary's copy); :mod:`.waits`: its waits (deadline, shutdown, roll-back).
- :mod:`.roster`: the trainers as one pserver sees them, and what a Hello learns;
  :mod:`.liveness`: :class:`~.liveness.Liveness`, the engine's live trainers as they join,
  close, fall silent or never come back, and who hears of it;
  :mod:`.stats`: the state Stats and /metrics report.
- :mod:`.contents`: what the pserver holds as requests name it (block names
  and layout, what a push or prefetch may carry, how a push splits): the
  servicer's, not the engine's.
- :mod:`.services`: the services beside the engine, each with its own lock:
  :class:`Reductions`, the Reduce service (trainers' global metrics), which
  asks the engine which trainers it expects, and :class:`StepClaims`, backup
  trainers' Claim service on the first pserver (which trainers make each sync
  step), built the same way.

Pure of gRPC: refusals are :mod:`pserver.errors`, mapped to statuses by :mod:`pserver.rpc`.
"""

from .contents import Contents, PushParts
from .engine import AsyncEngine, Engine, SyncEngine
from .listeners import FileWrites, Gate, Replication, ScheduledCheckpoints, ScheduledExports, UpdateListener
from .roster import Joined
from .services.claims import StepClaims
from .services.reductions import Reductions
from .stats import PserverStats

__all__ = [
    "Engine",
    "Joined",
    "SyncEngine",
    "AsyncEngine",
    "Contents",
    "PushParts",
    "Reductions",
    "StepClaims",
    "PserverStats",
    "UpdateListener",
    "FileWrites",
    "Gate",
    "Replication",
    "ScheduledCheckpoints",
    "ScheduledExports",
]
