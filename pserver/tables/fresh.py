"""Initial rows a lookup computed, kept for the insert that usually follows it.

A trainer's step looks up the rows of its next batch and, one step later, pushes their
gradients; ids not stored yet get their initial value (``initial_rows``) at the lookup and
again when the push inserts them. On a CTR stream about a third of a batch's ids are new, and
computing their initial rows is a third of a push's table work; keeping the rows the latest
lookups computed halves that. Initial rows are a pure function of (table seed, id), so a kept
row is the very value a recomputation gives.
"""
from __future__ import annotations

import collections
import threading
from typing import Deque, Tuple

import numpy as np


class FreshRows:
    """The initial rows of the ids the latest ``keep`` lookups missed, looked up by id.

    A lookup that missed more than ``max_rows`` ids (an evaluation pass, say) is not kept,
    which bounds the memory to ``keep * max_rows`` rows. Thread-safe.
    """

    def __init__(self, keep: int = 4, max_rows: int = 1 << 16):
        self.max_rows = max_rows
        self._kept: Deque[Tuple[np.ndarray, np.ndarray]] = collections.deque(maxlen=keep)
        self._lock = threading.Lock()

    def remember(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Keep ``rows``, the initial rows of ``ids`` (1-D int64, repeats allowed), replacing the oldest."""
        if ids.size == 0 or ids.size > self.max_rows:
            return
        order = np.argsort(ids, kind="stable")
        entry = (ids[order], rows[order])
        with self._lock:
            self._kept.append(entry)

    def take(self, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Fill ``out[i]`` with the kept row of ``ids[i]`` where one is kept; return the indices of the others."""
        with self._lock:
            kept = list(self._kept)
        left = np.arange(ids.size)
        for known, rows in reversed(kept):
            if left.size == 0:
                break
            want = ids[left]
            at = np.searchsorted(known, want)
            np.minimum(at, known.size - 1, out=at)
            hit = known[at] == want
            out[left[hit]] = rows[at[hit]]
            left = left[~hit]
        return left
