"""Routing version 2: slots owned by a jump consistent hash, so a change of pserver count moves only the
share of the pserver that came or went; version 1 still reads as it did."""

from __future__ import annotations

import numpy as np
import pytest

from transpiler.layout.routing import N_SLOTS, jump_hash, owner_of, slot_of, slot_owners
from transpiler.placement import stable_hash_ids


def jump_one(key: int, n_buckets: int) -> int:
    """Lamping and Veach's jump consistent hash of one key, as the paper writes it (the plain definition)."""
    b, j = -1, 0
    while j < n_buckets:
        b = j
        key = (key * 2862933555777941757 + 1) % (1 << 64)
        j = int((b + 1) * (float(1 << 31) / float((key >> 33) + 1)))
    return b


def ids_of(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return (np.arange(n, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)


@pytest.mark.parametrize("n_buckets", [1, 2, 3, 5, 8, 64, 1000])
def test_the_vectorised_jump_hash_is_the_plain_definition(n_buckets):
    keys = stable_hash_ids(ids_of(500))
    want = [jump_one(int(k), n_buckets) for k in keys]
    assert jump_hash(keys, n_buckets).tolist() == want


@pytest.mark.parametrize(
    "p_from, p_to, ideal",
    [(1, 2, 1 / 2), (2, 3, 1 / 3), (3, 4, 1 / 4), (4, 5, 1 / 5), (7, 8, 1 / 8), (15, 16, 1 / 16)],
)
def test_adding_a_pserver_moves_its_share_only_to_it_and_removing_it_moves_them_back(p_from, p_to, ideal):
    ids = ids_of(400_000)
    before, after = owner_of(ids, p_from), owner_of(ids, p_to)
    moved = before != after
    assert set(np.unique(after[moved]).tolist()) == {p_to - 1}  # only to the new pserver
    assert abs(moved.mean() - ideal) < 0.1 * ideal
    counts = np.bincount(after, minlength=p_to)
    assert counts.max() / counts.mean() < 1.06
    # Slots: the unit that moves.
    slots_moved = slot_owners(p_from) != slot_owners(p_to)
    assert np.array_equal(moved, slots_moved[slot_of(ids)])


def test_an_owner_is_the_owner_of_the_id_s_slot():
    ids = ids_of(10_000)
    assert np.array_equal(slot_of(ids), (stable_hash_ids(ids) % np.uint64(N_SLOTS)).astype(np.int64))
    assert np.array_equal(owner_of(ids, 7), slot_owners(7)[slot_of(ids)])
    assert not slot_owners(7).flags.writeable


@pytest.mark.parametrize("bad", [0, -1, 1 << 16, 2.0, "3"])
def test_a_layout_without_pservers_or_with_too_many_is_refused(bad):
    with pytest.raises(ValueError, match="pservers"):
        slot_owners(bad)


def test_an_unknown_routing_version_is_refused():
    with pytest.raises(ValueError, match="routing version 3"):
        owner_of(ids_of(3), 2, version=3)
