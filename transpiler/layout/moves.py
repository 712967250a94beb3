"""What a change of layout moves, and from which pserver to which: table slots and pieces of dense
blocks. Pure: the pservers stream what these name; ``ps-stat`` counts against their totals."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ..plans import ParamSpec
from .routing import N_SLOTS, slot_owners


@dataclass(frozen=True)
class BlockPiece:
    """Rows ``[row_start, row_end)`` of ``param`` (the parameter's own row numbers) that block
    ``block`` of the next layout, on ``to``, takes from block ``source`` of the current one, on
    ``source_pserver``."""

    param: str
    block: str
    to: str
    source: str
    source_pserver: str
    row_start: int
    row_end: int


def slots_between(n_now: int, n_next: int) -> Dict[Tuple[int, int], np.ndarray]:
    """``{(from, to): the slots that move from pserver position from to position to}``, sorted slots;
    only pairs that move something."""
    now, nxt = slot_owners(n_now), slot_owners(n_next)
    moving = np.flatnonzero(now != nxt)
    pairs: Dict[Tuple[int, int], np.ndarray] = {}
    for a, b in sorted(set(zip(now[moving].tolist(), nxt[moving].tolist()))):
        pairs[(a, b)] = moving[(now[moving] == a) & (nxt[moving] == b)]
    return pairs


def moved_slot_fraction(n_now: int, n_next: int) -> float:
    """The fraction of the slots (so, in expectation, of the rows) a change from ``n_now`` to
    ``n_next`` pservers moves."""
    now, nxt = slot_owners(n_now), slot_owners(n_next)
    return float(np.count_nonzero(now != nxt)) / N_SLOTS


def block_pieces(params_now: Sequence[ParamSpec], params_next: Sequence[ParamSpec]) -> List[BlockPiece]:
    """Every piece of a next block that lives on another pserver now: what the dense move streams.

    A next block is made of the rows of the current blocks it overlaps (the cut may differ: slicing
    depends on the pserver count); the pieces already on its pserver are not listed.
    """
    now = {p.name: p for p in params_now}
    pieces = []
    for p in params_next:
        if p.name not in now or list(now[p.name].shape) != list(p.shape):
            raise ValueError(f"parameter {p.name!r} is not in the current layout with shape {p.shape}")
        for b in p.blocks:
            for old in now[p.name].blocks:
                lo, hi = max(b.row_start, old.row_start), min(b.row_end, old.row_end)
                if lo < hi and old.endpoint != b.endpoint:
                    pieces.append(BlockPiece(p.name, b.name, b.endpoint, old.name, old.endpoint, lo, hi))
    return pieces


def piece_bytes(pieces: Sequence[BlockPiece], params: Sequence[ParamSpec]) -> int:
    """The bytes of parameter values ``pieces`` hold (their optimizer state comes on top, in proportion)."""
    row_bytes = {}
    for p in params:
        if p.blocks:
            b = p.blocks[0]
            row_bytes[p.name] = b.nbytes // max(1, b.row_end - b.row_start)
    return sum((x.row_end - x.row_start) * row_bytes[x.param] for x in pieces)
