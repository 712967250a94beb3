"""Which ids a table shard takes: int64 1-D ids, every one of them this shard's.

An id belongs to the shard :func:`transpiler.layout.routing.owner_of` names; a
misrouted id would be stored on the wrong pserver and never found by the others, so every id a push or
lookup names is checked, compiled where numba is (stopping at the first foreign id, no temporaries).
"""

from __future__ import annotations

import numpy as np

from transpiler.layout.routing import slot_owners
from transpiler.tables import as_ids, merge_duplicates, shard_of

from ..errors import BadRequest
from . import id_index


def as_shard_ids(ids) -> np.ndarray:
    """``ids`` read by :func:`transpiler.tables.as_ids`; :class:`BadRequest` if they are not 1-D integers."""
    if getattr(ids, "ndim", 1) != 1:
        raise BadRequest(f"ids must be 1-D, got shape {list(ids.shape)}")
    try:
        return as_ids(ids)
    except TypeError as e:
        raise BadRequest(str(e)) from None


def check_shard_ids(table: str, ids, shard: int, n_shards: int) -> None:
    """:class:`BadRequest` naming ``table``, the shard and an example id if any id is not ``shard``'s."""
    ids = as_shard_ids(ids)
    if n_shards == 1 or ids.size == 0:
        return
    kernels = id_index.load_kernels()
    if kernels is not None and kernels.first_foreign(ids, slot_owners(n_shards), shard) < 0:
        return
    owner = shard_of(ids, n_shards)
    bad = owner != shard
    if bad.any():
        i = int(np.argmax(bad))
        raise BadRequest(
            f"table {table!r}: {int(bad.sum())} of {ids.size} ids do not belong to "
            f"shard {shard} of {n_shards}, e.g. id {int(ids[i])} (shard {int(owner[i])})"
        )


def merged_gradient(table: str, ids, rows, shard: int, n_shards: int):
    """A table gradient ``(ids, rows)`` with every id checked to be ``shard``'s (:func:`check_shard_ids`)
    and repeated ids summed (:func:`transpiler.tables.merge_duplicates`); distinct ids come back as they
    are, found so in the shard check's compiled pass where numba is (no sort)."""
    ids = as_shard_ids(ids)
    kernels = id_index.load_kernels()
    if kernels is None:
        check_shard_ids(table, ids, shard, n_shards)
        return merge_duplicates(ids, rows)
    foreign, repeat = kernels.foreign_and_repeat(ids, slot_owners(n_shards), shard)
    if foreign >= 0:
        check_shard_ids(table, ids, shard, n_shards)  # refused, naming an example
    return (ids, rows) if repeat < 0 else merge_duplicates(ids, rows)
