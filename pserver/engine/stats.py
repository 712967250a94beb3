"""What a pserver holds right now, as one value: read by the Stats RPC and the Prometheus collector.

:meth:`pserver.engine.Engine.stats` takes it (the roster under the engine's
lock, nothing else held), so ``ps-stat`` and ``/metrics`` report the same
numbers from the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ..checkpoint.checkpointer import LastCheckpoint
from ..tables.table_set import TableStats


@dataclass(frozen=True)
class PserverStats:
    """One pserver's state: its step, trainers by state, what it stores, its latest checkpoint.

    ``alive`` are the trainers joined and live (heard from, not dropped or
    closed), ``dropped`` those silent past heartbeat_timeout, ``closed`` those
    done; ``trainers`` is how many the job was transpiled for.
    """

    step: int
    sync_mode: bool
    trainers: int
    alive: Tuple[int, ...]
    dropped: Tuple[int, ...]
    closed: Tuple[int, ...]
    blocks: int
    block_bytes: int
    table_rows: int
    table_bytes: int
    checkpoint: Optional[LastCheckpoint]
    tables: Tuple[TableStats, ...] = ()
