"""Transfers: one pserver's pull or push-pull, landing blocks where the caller says; every stepper uses these.

Blocks land in a destination the caller picks: the parameters
(:meth:`LocalBlocks.landing`), the async pipeline's staging buffers
(:meth:`LocalBlocks.stage`), or a node's flat parameter buffer
(``NodeGroup.param_dest``). Table rows asked ahead with a push land in new
tensors of the caller's ``rows`` dict (:class:`AskedRows`).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Iterable, Optional, Tuple

import torch

from psproto.dtypes import DTYPES
from transpiler.position import Position

from ..blocks import LocalBlocks
from ..communicator import Communicator

Dest = Callable[[str], torch.Tensor]


class AskedRows:
    """A push answer's destination that also takes the table rows asked ahead with the push.

    ``asked`` ({rows wire name: (dtype, shape)}) may grow until the answer
    comes (a push streamed during backward learns the next batch's ids at
    ``step()``); each asked name lands in a new tensor stored in ``rows``,
    every other name in ``blocks_dest``.
    """

    def __init__(self, blocks: LocalBlocks, blocks_dest: Dest, asked: Dict[str, tuple],
                 rows: Dict[str, torch.Tensor]):
        self._blocks, self._dest, self._asked, self._rows = blocks, blocks_dest, asked, rows

    def expect(self, name: str) -> Optional[Tuple[str, list]]:
        """(dtype, shape) of block or asked rows ``name``; None if neither."""
        return self._blocks.expect(name) or self._asked.get(name)

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._asked:
            dtype, shape = self._asked[name]
            self._rows[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            return self._rows[name]
        return self._dest(name)


class Transfers:
    """A trainer's per-pserver pulls and push-pulls of its blocks (the communicator does the wire)."""

    def __init__(self, comm: Communicator, blocks: LocalBlocks):
        self.comm = comm
        self.blocks = blocks

    def pull(self, endpoint: str, min_updates: int, dest: Optional[Dest] = None) -> int:
        """``endpoint``'s blocks once it applied ``min_updates``, into ``dest`` (default: the parameters).

        Returns the updates the pserver had applied.
        """
        landing = self.blocks.landing() if dest is None else None
        names = [b.name for b in self.blocks.by_endpoint[endpoint]]
        updates = self.comm.pull(endpoint, names, min_updates, self.blocks.expect, dest or landing)
        if landing is not None:
            landing.install()
        return updates

    def pull_all(self, min_updates: int) -> None:
        """Every pserver's blocks into the parameters, all pservers in parallel."""
        self.comm.run_parallel({ep: (lambda ep=ep: self.pull(ep, min_updates)) for ep in self.blocks.by_endpoint})

    def push_pull(self, endpoint: str, step: int, tensors: Iterable[Tuple[str, torch.Tensor]], position: Position,
                  dest: Optional[Dest] = None, asked: Optional[Dict[str, tuple]] = None,
                  rows: Optional[Dict[str, torch.Tensor]] = None, streamed: bool = False) -> int:
        """Push ``step``'s ``tensors`` to ``endpoint``; its fresh blocks land in ``dest`` (default: the parameters).

        ``asked`` / ``rows``: table rows asked ahead with the push, landing in
        ``rows`` (see :class:`AskedRows`). ``streamed``: ``tensors`` come as
        backward produces them. Returns the updates the pserver had applied.
        """
        landing = self.blocks.landing() if dest is None else None
        into = dest or landing
        expect = self.blocks.expect
        answer_bytes = self.blocks.answer_bytes.get(endpoint, 0)
        if asked is not None:
            into = AskedRows(self.blocks, into, asked, rows)
            expect = into.expect
            answer_bytes += sum(math.prod(shape) * DTYPES[dtype].itemsize for dtype, shape in asked.values())
        updates = self.comm.push_pull(endpoint, step, tensors, expect, into, position, streamed,
                                      answer_bytes=None if streamed else answer_bytes)
        if landing is not None:
            landing.install()
        return updates
