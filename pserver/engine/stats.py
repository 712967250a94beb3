"""What a pserver holds right now, as one value: read by the Stats RPC and the Prometheus collector.

:meth:`pserver.engine.Engine.stats` takes it (the roster under the engine's
lock, nothing else held), so ``ps-stat`` and ``/metrics`` report the same
numbers from the same place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, AbstractSet, Optional, Tuple

from ..checkpoint.checkpointer import LastCheckpoint
from ..tables.table_set import TableStats

if TYPE_CHECKING:
    from ..checkpoint import Checkpointer
    from ..store import BlockStore
    from ..tables import TableSet


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

    @classmethod
    def of(
        cls,
        step: int,
        sync_mode: bool,
        trainers: int,
        states: Tuple[AbstractSet[int], AbstractSet[int], AbstractSet[int]],
        store: BlockStore,
        tables: TableSet,
        checkpointer: Optional[Checkpointer],
    ) -> PserverStats:
        """The value at ``step``, with the trainers by state (alive, dropped, closed, copied under the
        engine's lock) and what ``store``, ``tables`` and ``checkpointer`` hold now."""
        alive, dropped, closed = states
        return cls(
            step,
            sync_mode,
            trainers,
            tuple(sorted(alive)),
            tuple(sorted(dropped)),
            tuple(sorted(closed)),
            len(store.blocks),
            store.nbytes,
            tables.rows,
            tables.nbytes,
            checkpointer.last if checkpointer is not None else None,
            tables.stats(),
        )
