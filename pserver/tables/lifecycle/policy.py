"""RowLifecycle: what a table shard keeps per row and decides per step for admission and eviction.

The shard owns the arrays and moves the rows; this object owns the policy
(:class:`transpiler.lifecycle.TableLifecycle`): which metadata columns rows
carry, how an update touches them, which pending ids are admitted
(:mod:`.admission`), which rows a step's end evicts (:mod:`.eviction`), the
counts operators see, and the ids evicted since the last export (the
tombstones a delta export carries).

Metadata columns (one value per stored row, kept with the row through growth,
compaction, saves, re-shards and the disk tier)::

    seen_step  int64    table step of the row's last update (always: deltas and every rule need it)
    score      float64  decayed update count as of seen_step (score rule or row budget)
    seen_time  float64  wall-clock second of the last update (evict_unseen_seconds)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List

import numpy as np

from transpiler.tables import TableSpec

from . import eviction
from .admission import Admission

META_COLUMNS: Dict[str, np.dtype] = {
    "seen_step": np.dtype(np.int64),
    "score": np.dtype(np.float64),
    "seen_time": np.dtype(np.float64),
}


@dataclass
class LifecycleCounts:
    """Rows admitted / refused / evicted / spilled / promoted since the shard started (for metrics)."""

    admitted: int = 0
    refused: int = 0
    evicted: int = 0
    spilled: int = 0
    promoted: int = 0
    by_rule: Dict[str, int] = field(default_factory=dict)


class RowLifecycle:
    """Admission, metadata upkeep and eviction decisions of one table shard.

    ``clock`` gives wall-clock seconds (injectable for tests of
    ``evict_unseen_seconds``). Not thread-safe: the shard calls it under its lock.
    """

    def __init__(self, spec: TableSpec, n_shards: int, clock: Callable[[], float] = time.time):
        self.policy = spec.lifecycle
        self.n_shards = n_shards
        self.clock = clock
        lc = self.policy
        self.columns: List[str] = ["seen_step"]
        if lc.scores:
            self.columns.append("score")
        if lc.evict_unseen_seconds:
            self.columns.append("seen_time")
        self.admission = None if lc.admits_all else Admission(lc, spec.seed)
        self.counts = LifecycleCounts()
        self.tracks_tombstones = False
        self._tombstones: List[np.ndarray] = []

    @property
    def evicts(self) -> bool:
        return self.policy.sweeps or bool(self.policy.max_rows)

    @property
    def plain(self) -> bool:
        """Nothing to decide per row: every id admitted, none evicted, only ``seen_step`` kept."""
        return self.admission is None and not self.evicts and self.columns == ["seen_step"]

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """Which pending ``ids`` (distinct, holding no row) get a row this step (bool per id)."""
        if self.admission is None:
            ok = np.ones(ids.size, dtype=bool)
        else:
            ok = self.admission.admit(ids)
        n_ok = int(ok.sum())
        self.counts.admitted += n_ok
        self.counts.refused += ids.size - n_ok
        return ok

    def touch(self, meta: Dict[str, np.ndarray], rows: np.ndarray, step: int) -> None:
        """Record an update at ``step`` of the stored rows ``rows`` in the metadata views ``meta``."""
        if "score" in meta:
            meta["score"][rows] = eviction.updated_scores(
                meta["score"][rows], meta["seen_step"][rows], step, self.policy.score_decay
            )
        if "seen_time" in meta:
            meta["seen_time"][rows] = self.clock()
        meta["seen_step"][rows] = step

    def victims(self, ids: np.ndarray, meta: Dict[str, np.ndarray], step: int) -> np.ndarray:
        """Row numbers (sorted, distinct) the end of ``step`` evicts; ``ids``/``meta`` cover the live rows."""
        lc = self.policy
        go = np.empty(0, dtype=np.int64)
        if eviction.sweep_due(lc, step):
            go = np.flatnonzero(
                eviction.sweep_victims(
                    lc, step, self.clock(), meta["seen_step"], meta.get("score"), meta.get("seen_time")
                )
            )
            self._count("sweep", go.size)
        keep = eviction.budget_keep(lc, ids.size - go.size, self.n_shards)
        if keep is not None:
            left = np.setdiff1d(np.arange(ids.size), go, assume_unique=True)
            over = eviction.lowest_ranked(
                left.size - keep,
                step,
                lc.score_decay,
                ids[left],
                meta["seen_step"][left],
                meta["score"][left],
            )
            self._count("budget", over.size)
            go = np.union1d(go, left[over])
        return go

    def reshare(self, n_shards: int) -> None:
        """The shares of a shard of ``n_shards`` (the job's pserver count changed)."""
        self.n_shards = n_shards

    def end_step(self, step: int) -> None:
        """Per-step upkeep after evictions: the admission counts' decay."""
        if self.admission is not None:
            self.admission.end_step(step)

    def evicted(self, ids: np.ndarray) -> None:
        """Note ``ids`` evicted (for the count and, when exports run, the next delta's tombstones)."""
        self.counts.evicted += ids.size
        if self.tracks_tombstones and ids.size:
            self._tombstones.append(ids.copy())

    def admitted(self, n: int) -> None:
        """Note ``n`` ids given a row with nothing to decide (a plain table's compiled apply)."""
        self.counts.admitted += n

    def track_tombstones(self, on: bool = True) -> None:
        """Keep the ids evicted from now on for :meth:`take_tombstones` (exports run), or stop."""
        self.tracks_tombstones = on

    def spilled(self, n: int) -> None:
        """Note ``n`` rows moved to the disk tier."""
        self.counts.spilled += n

    def promoted(self, n: int) -> None:
        """Note ``n`` rows brought back from the disk tier."""
        self.counts.promoted += n

    def take_tombstones(self) -> np.ndarray:
        """Ids evicted since the previous call (sorted, distinct), forgetting them."""
        out = np.unique(np.concatenate(self._tombstones)) if self._tombstones else np.empty(0, np.int64)
        self._tombstones = []
        return out

    def _count(self, rule: str, n: int) -> None:
        if n:
            self.counts.by_rule[rule] = self.counts.by_rule.get(rule, 0) + n

    def defaults(self, step: int) -> Dict[str, object]:
        """Metadata of rows loaded from files that lack a column: updated now, score 1."""
        return {"seen_step": step, "score": 1.0, "seen_time": self.clock()}
