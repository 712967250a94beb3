"""A digest of a pserver shard's state, to check that a backup holds what its primary holds.

Both replicas apply the same updates in the same order, so their bits agree;
the primary sends its digest every ``replica_digest_every`` updates and the
backup compares it with its own (:mod:`.follower`), logging a mismatch. The
digest covers the blocks and their optimizer state, each table's rows held in
memory with their optimizer state and metadata, in id order (where rows sit in
memory may differ: lookups promote rows on the primary only), the tables'
step counts and rows on disk, and the trainers' progress. The wall-clock
``seen_time`` column is left out: it is each process's own clock.
"""
from __future__ import annotations

import hashlib
import json

import numpy as np
import torch

# Row metadata that is each process's clock, not state both replicas share.
CLOCK_COLUMNS = ("seen_time",)


def _tensor_bytes(h, t: torch.Tensor) -> None:
    h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
             if t.numel() else b"")


def state_digest(store, tables, roster_meta: dict) -> str:
    """The hex digest of the blocks, optimizer state, table shards and ``roster_meta`` (under the engine's lock)."""
    h = hashlib.sha256()
    for name in sorted(store.blocks):
        block = store.blocks[name]
        h.update(name.encode())
        _tensor_bytes(h, block)
        state = store.optimizer.state.get(block, {}) if store.optimizer is not None else {}
        for key in sorted(state):
            value = state[key]
            h.update(key.encode())
            if isinstance(value, torch.Tensor):
                _tensor_bytes(h, value)
            else:
                h.update(repr(value).encode())
    for name in sorted(tables.names()):
        shard = tables.shards[name]
        with shard._lock:
            n = shard._n
            order = np.argsort(shard._ids[:n], kind="stable")
            h.update(f"{name}:{shard.step}:{n}:{shard.disk_rows}".encode())
            h.update(shard._ids[:n][order].tobytes())
            h.update(np.ascontiguousarray(shard._rows[:n][order]).tobytes())
            for state in shard._state:
                h.update(np.ascontiguousarray(state[:n][order]).tobytes())
            for column, values in sorted(shard._meta.items()):
                if column not in CLOCK_COLUMNS:
                    h.update(np.ascontiguousarray(values[:n][order]).tobytes())
    h.update(json.dumps(roster_meta, sort_keys=True).encode())
    return h.hexdigest()[:32]
