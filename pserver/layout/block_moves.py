"""Moving dense blocks to the next layout: the rows each pserver sends (the pieces of the next blocks it
holds now, with their optimizer state) and the next blocks built from what a pserver keeps and receives.

Cut by :func:`transpiler.placement.cut_block`, as a checkpoint loads into another slicing, so the next
blocks equal a re-sharded checkpoint's (tested). Dense state is small beside the tables': it moves whole
at the switch, not streamed ahead.
"""

from __future__ import annotations

from typing import Dict, Iterable, Mapping, Sequence

from transpiler.layout.moves import BlockPiece
from transpiler.placement import by_param, cut_block
from transpiler.plans import PserverProgram

from ..store import BlockStore


def pieces_to(saved: Mapping[str, dict], pieces: Sequence[BlockPiece], to: str) -> Dict[str, dict]:
    """The rows of this pserver's blocks (``saved``: ``BlockStore.saved_blocks()``) that pserver ``to``'s
    next blocks take, cut to the pieces and keyed ``<source>@<row_start>``, in ``saved``'s format."""
    out = {}
    for p in pieces:
        if p.to != to or p.source not in saved:
            continue
        entry = saved[p.source]
        value, state = cut_block(
            {p.param: [entry]}, p.param, p.row_start, p.row_end, _shape(entry, p.row_end - p.row_start)
        )
        out[f"{p.source}@{p.row_start}"] = {
            "param": p.param,
            "row_start": p.row_start,
            "row_end": p.row_end,
            "value": value,
            "state": state,
        }
    return out


def _shape(entry: dict, rows: int) -> list:
    shape = list(entry["value"].shape)
    return [rows] + shape[1:] if shape else []


def next_blocks(program: PserverProgram, kept: Mapping[str, dict], received: Iterable[Mapping[str, dict]]):
    """The :class:`~pserver.store.BlockStore` of ``program`` (the next layout's plan of this pserver), its
    blocks and optimizer state cut from the blocks it ``kept`` (its own ``saved_blocks()``) and the
    pieces it ``received``; ValueError if they miss a row."""
    store = BlockStore(program, None)
    store.restore(by_param([kept, *received]))
    return store
