"""Modes: what each training mode decides about a push, one handler per mode that the engine calls.

ps-lite's request handle. The engine (:mod:`pserver.engine.engine`) keeps what every mode shares and
hands every push to its handler, chosen once from the plan (:func:`for_plan`):

- :mod:`.mode`: :class:`Mode`, the handler's interface (whether a push counts, when and as what it is
  applied, the step its answer waits for, whether reads copy), :class:`Arrival` (a push's step against
  the pserver's: new, duplicate, stale, ahead) and :class:`~.mode.EngineParts`, what a handler uses
  of its engine;
- :mod:`.sync`: :class:`SyncMode`, the barrier: the step's pushes summed in a
  :class:`~pserver.engine.pending.PendingStep`, their mean applied once every expected trainer's came;
- :mod:`.backup_steps`: backup trainers' side of a sync step (the trainers a push names, pushes
  dropped from it): decisions and refusals the sync handler uses;
- :mod:`.asynchronous`: :class:`AsyncMode`, apply on arrival, ``max_staleness`` parking a push
  too far ahead of the slowest trainer;
- :mod:`.geo_deltas`: :class:`GeoMode`, GEO's pushes applied on arrival as deltas scaled by 1 / trainers.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

from transpiler import PserverProgram

from .asynchronous import AsyncMode
from .geo_deltas import GeoMode
from .mode import Arrival, EngineParts, Mode
from .sync import SyncMode


def for_plan(program: PserverProgram) -> Callable[[EngineParts], Mode]:
    """The handler of ``program``'s mode, for the engine to build: sync, GEO (``k_steps``; asynchronous),
    or async (with the plan's ``max_staleness``)."""
    if program.sync_mode:
        return SyncMode
    if program.config.k_steps:
        return GeoMode
    return partial(AsyncMode, max_staleness=program.config.max_staleness)


__all__ = ["Arrival", "AsyncMode", "EngineParts", "GeoMode", "Mode", "SyncMode", "for_plan"]
