"""Stable hashes: the same answer in every process, run and Python version.

Python's ``hash()`` of a str is salted per process, so it cannot place blocks
or route ids: two roles would disagree on where a block lives.
"""
from __future__ import annotations

import hashlib

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def stable_hash_name(name: str) -> int:
    """Return a 64-bit unsigned hash of ``name`` (BLAKE2b of its UTF-8 bytes)."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def stable_hash_ids(ids: np.ndarray) -> np.ndarray:
    """Return the splitmix64 finaliser of every int64 id, as uint64.

    Vectorised over the whole array; used to route embedding ids to pservers
    and to seed their rows, so neither depends on arrival order.
    """
    x = np.asarray(ids, dtype=np.int64).view(np.uint64).copy()
    with np.errstate(over="ignore"):
        x += np.uint64(0x9E3779B97F4A7C15)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x & _MASK64
