"""Where everything lives: parameters sliced into row blocks, blocks dealt to pservers, ids routed by
stable hashes.

Stable hashes give the same answer in every process, run and Python version. Python's ``hash()`` of a str
is salted per process, so it cannot place blocks or route ids: two roles would disagree on where a block
lives.
"""

from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np
import torch

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


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the 2-D (dim-0 rows, rest) view blocks are cut from; a scalar is one row."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


def by_param(saved_blocks: Iterable[Mapping[str, dict]]) -> Dict[str, List[dict]]:
    """Saved blocks (``{block: {"param", "row_start", "row_end", "value", "state"}}``, of one pserver or
    several) grouped by parameter and ordered by first row: what :func:`cut_block` cuts from."""
    grouped: Dict[str, List[dict]] = {}
    for saved in saved_blocks:
        for entry in saved.values():
            grouped.setdefault(entry["param"], []).append(entry)
    for entries in grouped.values():
        entries.sort(key=lambda e: e["row_start"])
    return grouped


def cut_block(
    saved: Dict[str, List[dict]], param: str, row_start: int, row_end: int, shape: Sequence[int]
) -> Tuple[torch.Tensor, dict]:
    """(value, optimizer state) of rows ``[row_start, row_end)`` of ``param``, cut from saved blocks.

    The saved blocks may slice the parameter differently. State tensors shaped
    like their block are cut the same way; anything else (a step count) is
    taken from the first saved block the rows come from.
    """
    pieces = [e for e in saved.get(param, []) if e["row_start"] < row_end and e["row_end"] > row_start]
    covered = row_start
    for e in pieces:
        if e["row_start"] > covered:
            break
        covered = max(covered, e["row_end"])
    if covered < row_end:
        raise ValueError(f"the checkpoint holds no rows {covered}..{row_end} of parameter {param!r}")

    def cut(get) -> torch.Tensor:
        return torch.cat(
            [
                as_rows(get(e))[
                    max(row_start, e["row_start"]) - e["row_start"] : min(row_end, e["row_end"])
                    - e["row_start"]
                ]
                for e in pieces
            ]
        )

    value = cut(lambda e: e["value"]).reshape(shape)
    state = {}
    for key, first in pieces[0]["state"].items():
        if torch.is_tensor(first) and first.shape == pieces[0]["value"].shape and first.dim() > 0:
            state[key] = cut(lambda e: e["state"][key]).reshape(shape).clone()
        else:
            state[key] = first.clone() if torch.is_tensor(first) else first
    return value, state


def block_count(numel: int, rows: int, n_pservers: int, min_block_size: int, slice_var_up: bool) -> int:
    """Number of blocks for a parameter of ``numel`` elements and ``rows`` dim-0 rows.

    ``min(#pservers, max(1, numel // min_block_size))`` when slicing, never more
    than the parameter has rows (a block holds whole rows); 1 otherwise.
    """
    if not slice_var_up:
        return 1
    return max(1, min(n_pservers, numel // min_block_size, rows))


def split_rows(rows: int, n_blocks: int) -> List[Tuple[int, int]]:
    """Cut ``rows`` into ``n_blocks`` half-open ranges as equal as rows allow.

    The first ``rows % n_blocks`` blocks get one extra row.
    """
    if n_blocks < 1 or n_blocks > max(rows, 1):
        raise ValueError(f"cannot cut {rows} rows into {n_blocks} blocks")
    base, extra = divmod(rows, n_blocks)
    ranges, start = [], 0
    for i in range(n_blocks):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


class RoundRobin:
    """Deal blocks to pservers in order: block k of the program goes to k % n."""

    def __init__(self, endpoints: Sequence[str]):
        self.endpoints = list(endpoints)
        self._next = 0

    def dispatch(self, block_names: Sequence[str]) -> List[str]:
        out = []
        for _ in block_names:
            out.append(self.endpoints[self._next % len(self.endpoints)])
            self._next += 1
        return out


class HashName:
    """Place each block by a stable hash of its name, independent of order."""

    def __init__(self, endpoints: Sequence[str]):
        self.endpoints = list(endpoints)

    def dispatch(self, block_names: Sequence[str]) -> List[str]:
        n = len(self.endpoints)
        return [self.endpoints[stable_hash_name(name) % n] for name in block_names]


DISPATCHERS = {"RoundRobin": RoundRobin, "HashName": HashName}
