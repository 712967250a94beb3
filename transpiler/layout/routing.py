"""Which pserver owns a table id: the routing, versioned, and built to move little when pservers come and go.

Version 2 (today's): an id's *slot* is the low :data:`SLOT_BITS` bits of ``stable_hash_ids(id)``; each of
the :data:`N_SLOTS` slots has an owner, ``jump_hash(slot, P)`` (Lamping and Veach's jump consistent hash)
for ``P`` pservers. Going from ``P`` to ``P + 1`` pservers hands each slot to the new pserver with
probability ``1 / (P + 1)`` and moves no other slot; going back moves exactly those slots home. Version 1,
``stable_hash_ids(id) % P``, moved ``P / (P + 1)`` of the rows on such a change; files saved under it are
still read (they are re-routed on load, as a change of pserver count is).

Why slots rather than jumping on each id's hash (same moves): the owner is one lookup in a 64 kB table, the
slot is the unit a move streams and counts, and a table of owners can say what a pure function of ``P``
cannot (a pserver removed from the middle). ``benchmarks/bench_routing.py`` measured the candidates
(RESULTS.md, "Routing that moves little").
"""

from __future__ import annotations

import functools

import numpy as np

from ..placement import stable_hash_ids
from .change_checks import MAX_PSERVERS

ROUTING_VERSION = 2
ROUTING_VERSIONS = (1, 2)
SLOT_BITS = 14
N_SLOTS = 1 << SLOT_BITS
_SLOT_MASK = np.uint64(N_SLOTS - 1)
# The most pservers a layout may name: an owner is stored as int32, and the table of owners is checked.

_JUMP_MULTIPLIER = np.uint64(2862933555777941757)


def jump_hash(keys: np.ndarray, n_buckets: int) -> np.ndarray:
    """Jump consistent hash of every uint64 key into ``[0, n_buckets)``, as int64.

    Vectorised: each round advances every key still jumping (about ``ln n_buckets`` rounds). A key's
    bucket for ``n + 1`` buckets is its bucket for ``n`` or ``n`` itself.
    """
    if n_buckets < 1:
        raise ValueError(f"jump_hash needs at least one bucket, got {n_buckets}")
    key = np.asarray(keys, dtype=np.uint64).copy()
    bucket = np.zeros(key.shape, dtype=np.int64)
    nxt = np.zeros(key.shape, dtype=np.int64)
    live = np.ones(key.shape, dtype=bool)
    with np.errstate(over="ignore"):
        while live.any():
            bucket[live] = nxt[live]
            key[live] = key[live] * _JUMP_MULTIPLIER + np.uint64(1)
            step = float(1 << 31) / ((key[live] >> np.uint64(33)).astype(np.float64) + 1.0)
            nxt[live] = ((bucket[live] + 1).astype(np.float64) * step).astype(np.int64)
            live[live] = nxt[live] < n_buckets
    return bucket


@functools.lru_cache(maxsize=64)
def _owners(n_pservers: int) -> np.ndarray:
    owners = jump_hash(np.arange(N_SLOTS, dtype=np.uint64), n_pservers).astype(np.int32)
    owners.setflags(write=False)
    return owners


def slot_owners(n_pservers: int) -> np.ndarray:
    """The owner of every slot for ``n_pservers`` pservers (read-only int32, :data:`N_SLOTS` long)."""
    if not isinstance(n_pservers, (int, np.integer)) or not 1 <= n_pservers <= MAX_PSERVERS:
        raise ValueError(f"a layout needs 1 to {MAX_PSERVERS} pservers, got {n_pservers!r}")
    return _owners(int(n_pservers))


def slot_of(ids: np.ndarray) -> np.ndarray:
    """The slot of every int64 id (int64): the low :data:`SLOT_BITS` bits of its stable hash."""
    return (stable_hash_ids(ids) & _SLOT_MASK).astype(np.int64)


def owner_of(ids: np.ndarray, n_pservers: int, version: int = ROUTING_VERSION) -> np.ndarray:
    """The pserver (index) of every id under routing ``version`` with ``n_pservers`` pservers, as int64."""
    if version == 2:
        return slot_owners(n_pservers)[slot_of(ids)].astype(np.int64)
    if version == 1:
        return (stable_hash_ids(ids) % np.uint64(n_pservers)).astype(np.int64)
    raise ValueError(f"unknown routing version {version!r}; known: {list(ROUTING_VERSIONS)}")
