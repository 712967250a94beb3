"""A digest of a pserver shard's state, to check that a backup holds what its primary holds.

Both replicas apply the same updates in the same order, so their bits agree;
the primary sends its digest every ``replica_digest_every`` updates and the
backup compares it with its own (:mod:`.follower`), logging a mismatch. The
digest covers the blocks and their optimizer state (hashed in name order), and
each table's rows held in memory with their optimizer state and metadata, its
step count and its rows on disk, and the trainers' progress. Where a table's
rows sit in memory may differ between replicas (lookups promote rows on the
primary only), so rows are folded in an order-free way: a mixed 64-bit hash per
row, summed, vectorised over the whole table (a sort and a SHA-256 of every row
cost the primary, under its lock, half a second per million rows). It detects
divergence; it is no cryptographic hash. The wall-clock ``seen_time`` column is
left out: it is each process's own clock.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

# Row metadata that is each process's clock, not state both replicas share.
CLOCK_COLUMNS = ("seen_time",)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX = np.uint64(0xFF51AFD7ED558CCD)


def _tensor_bytes(h, t: torch.Tensor) -> None:
    h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")


def _words(column: np.ndarray, n: int) -> np.ndarray:
    """``column``'s first ``n`` rows as 64-bit words per row (floats and ints alike, bit for bit)."""
    a = np.ascontiguousarray(column[:n]).reshape(n, -1)
    if (a.shape[1] * a.dtype.itemsize) % 8 == 0:
        return a.view(np.uint64)  # the row's bytes as they are, no copy
    return a.astype(np.float64 if a.dtype.kind == "f" else np.int64).view(np.uint64)


def fold_rows(ids: np.ndarray, columns) -> int:
    """An order-free 64-bit digest of rows: each row's id and ``columns`` mixed into one word, summed."""
    with np.errstate(over="ignore"):
        acc = ids.astype(np.int64).view(np.uint64) * _GOLDEN
        for k, column in enumerate(columns):
            words = _words(column, ids.size)
            weights = (
                np.arange(words.shape[1], dtype=np.uint64) * np.uint64(2) + np.uint64(2 * k + 1)
            ) * _GOLDEN
            acc = (acc ^ (words * weights).sum(axis=1, dtype=np.uint64)) * _MIX
            acc ^= acc >> np.uint64(29)
        return int(acc.sum(dtype=np.uint64))


def state_digest(store, tables, roster_meta: dict) -> str:
    """The hex digest of the blocks, optimizer state, table shards and ``roster_meta`` (under the engine's
    lock)."""
    h = hashlib.sha256()
    for name in sorted(store.blocks):
        block = store.blocks[name]
        h.update(name.encode())
        _tensor_bytes(h, block)
        state = store.block_state(name)
        for key in sorted(state):
            value = state[key]
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                _tensor_bytes(h, value)
            else:
                h.update(repr(value).encode())
    for name in sorted(tables.names()):
        shard = tables.shards[name]
        with shard.reading() as memory:
            columns = [
                memory.rows,
                *memory.state,
                *(values for column, values in sorted(memory.meta.items()) if column not in CLOCK_COLUMNS),
            ]
            rows = fold_rows(memory.ids, columns)
            h.update(f"{name}:{shard.step}:{len(memory)}:{shard.disk_rows}:{rows}".encode())
    h.update(json.dumps(roster_meta, sort_keys=True).encode())
    return h.hexdigest()[:32]
