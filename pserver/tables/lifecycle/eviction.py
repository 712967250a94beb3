"""Eviction and spill decisions over a shard's row metadata: pure functions of arrays.

The rules are :mod:`transpiler.lifecycle`'s. Each function takes the metadata
columns of the rows stored (``seen_step``: the table step of each row's last
update; ``score``: its decayed update count as of ``seen_step``; ``seen_time``:
the wall-clock second of its last update) and says which rows go; the shard
removes them (:mod:`pserver.tables.shard`). Ties are broken by id, so the same
rows go on every run.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from transpiler.lifecycle import BUDGET_LOW_WATER, TableLifecycle


def decayed(score: np.ndarray, seen_step: np.ndarray, step: int, decay: float) -> np.ndarray:
    """Scores as of ``step``: ``score * decay ** (step - seen_step)`` (float64)."""
    if decay == 1.0:
        return score.astype(np.float64, copy=True)
    return score * np.power(decay, (step - seen_step).astype(np.float64))


def updated_scores(score: np.ndarray, seen_step: np.ndarray, step: int, decay: float) -> np.ndarray:
    """Scores of rows updated at ``step``: their decayed score plus one."""
    out = decayed(score, seen_step, step, decay)
    out += 1.0
    return out


def sweep_due(lc: TableLifecycle, step: int) -> bool:
    """Whether an eviction sweep runs at the end of ``step``."""
    return lc.sweeps and step % lc.sweep_every_steps == 0


def sweep_victims(
    lc: TableLifecycle,
    step: int,
    now: float,
    seen_step: np.ndarray,
    score: Optional[np.ndarray],
    seen_time: Optional[np.ndarray],
) -> np.ndarray:
    """Rows (bool per row) a sweep at the end of ``step`` (wall clock ``now``) removes.

    Unseen for ``evict_unseen_steps`` steps, for ``evict_unseen_seconds``
    seconds, or with a decayed score below ``evict_score_below``: any rule set.
    """
    out = np.zeros(seen_step.size, dtype=bool)
    if lc.evict_unseen_steps:
        out |= step - seen_step >= lc.evict_unseen_steps
    if lc.evict_unseen_seconds and seen_time is not None:
        out |= now - seen_time >= lc.evict_unseen_seconds
    if lc.evict_score_below and score is not None:
        out |= decayed(score, seen_step, step, lc.score_decay) < lc.evict_score_below
    return out


def budget_keep(lc: TableLifecycle, n_rows: int, n_shards: int) -> Optional[int]:
    """Rows a shard keeps when ``n_rows`` is over its share of ``max_rows``; None when within it."""
    if not lc.max_rows:
        return None
    share = lc.shard_share(lc.max_rows, n_shards)
    if n_rows <= share:
        return None
    return int(share * BUDGET_LOW_WATER)


def lowest_ranked(
    n_go: int, step: int, decay: float, ids: np.ndarray, seen_step: np.ndarray, score: np.ndarray
) -> np.ndarray:
    """Row numbers of the ``n_go`` lowest-ranked rows: lowest decayed score, then oldest, then smallest id."""
    if n_go <= 0:
        return np.empty(0, dtype=np.int64)
    order = np.lexsort((ids, seen_step, decayed(score, seen_step, step, decay)))
    return order[:n_go]


def coldest(n_go: int, ids: np.ndarray, seen_step: np.ndarray) -> np.ndarray:
    """Row numbers of the ``n_go`` least recently updated rows (then smallest id): what the disk tier
    takes."""
    if n_go <= 0:
        return np.empty(0, dtype=np.int64)
    if n_go < seen_step.size // 4:
        # A partition finds the cut; only rows at the cut's step need the id tie-break.
        cut = np.partition(seen_step, n_go - 1)[n_go - 1]
        below = np.flatnonzero(seen_step < cut)
        at = np.flatnonzero(seen_step == cut)
        at = at[np.argsort(ids[at], kind="stable")][: n_go - below.size]
        return np.concatenate([below, at])
    return np.lexsort((ids, seen_step))[:n_go]
