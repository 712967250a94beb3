"""Transfers: a step's push to every pserver, pulls, and row fetches, in parallel over the trainer's channels.

A stepper describes a step's push once (:class:`StepPush`) and hands it to
:meth:`Transfers.push_all`, through its heal (``Stepper.push``). Blocks land
where the push says: the parameters (:meth:`LocalBlocks.landing`), the async
pipeline's staging buffers (:meth:`LocalBlocks.stage`), or a node's flat
parameter buffer (``NodeGroup.param_dest``). Table rows asked ahead with a
push land in new tensors of the push's ``next_rows`` (:class:`BlocksAndNextRows`).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Dict, Iterable, Iterator, Mapping, Optional, Sequence, Tuple

import torch

from psproto.dtypes import DTYPES
from transpiler.position import Position

from ..blocks import Landing, LocalBlocks
from ..embedding import RowFetch, RowsByPserver, RowShapes
from ..errors import PserverError
from ..transport import (
    Channels,
    DecodeInto,
    DtypeAndShape,
    Named,
    NamedTensors,
    StartedPush,
    TensorsByPserver,
    answered_first,
)


@dataclass(frozen=True)
class StepPush:
    """One step's push to every pserver it goes to, and where the answers land.

    ``tensors``: per pserver pushed to, what the push sends it: its blocks'
    gradients, then the tables', then the next batch's ids asked ahead
    (``"<table>@next"``); every pserver in it is pushed to, even with nothing
    for it, so sync barriers count this trainer. ``next_batch``: what those ids ask each
    pserver for; the rows land in ``next_rows`` (a dict per pserver that
    gets rows, filled as the answers come). ``blocks_into``: where fresh
    blocks land (None: the parameters). Backup trainers: ``step_trainers``, the
    step's trainers this push counts among, or ``dropped`` (it carries no
    gradients). What the answers report is :meth:`Transfers.push_all`'s result.
    """

    step: int
    position: Position  # the data position after this step, kept in checkpoints
    tensors: Mapping[str, NamedTensors]
    next_batch: Optional[RowFetch] = None
    next_rows: RowsByPserver = field(default_factory=dict)
    blocks_into: Optional[DecodeInto] = None
    step_trainers: Tuple[int, ...] = ()
    dropped: bool = False


class PushTensors(Mapping[str, NamedTensors]):
    """Per pserver of ``endpoints``: its blocks' gradients, read when the push is sent, then its tensors of
    ``tail``.

    ``tail``: the tables' gradients and the next batch's ids. Read when sent, so a push whose blocks
    streamed during backward reads them only to send them again; a push sent later (the async pipeline)
    gathers them at once (``dict(...)``), before the next backward.
    """

    def __init__(self, blocks: LocalBlocks, endpoints: Sequence[str], tail: TensorsByPserver):
        self._blocks, self._endpoints = blocks, list(endpoints)
        self.tail = tail

    def __getitem__(self, endpoint: str) -> NamedTensors:
        if endpoint not in self._endpoints:
            raise KeyError(endpoint)
        return self._blocks.grads(endpoint) + self.tail.get(endpoint, [])

    def __iter__(self) -> Iterator[str]:
        return iter(self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)


class BlocksAndNextRows:
    """A push answer's destination: blocks where ``blocks_into`` says, and the rows asked ahead in new
    tensors.

    ``next_rows`` ({rows wire name: (dtype, shape)}) may grow until the answer comes (a push streamed
    during backward learns the next batch's ids at ``step()``); each of those lands in a new tensor stored
    in ``landed``, every other name in ``blocks_into``.
    """

    def __init__(
        self,
        blocks: LocalBlocks,
        blocks_into: DecodeInto,
        next_rows: RowShapes,
        landed: Dict[str, torch.Tensor],
    ):
        self._blocks, self._blocks_into, self._next_rows, self._landed = (
            blocks,
            blocks_into,
            next_rows,
            landed,
        )

    def dtype_and_shape(self, name: str) -> Optional[tuple]:
        """(dtype, shape) of block or rows ``name``; None if neither."""
        return self._blocks.dtype_and_shape(name) or self._next_rows.get(name)

    def __call__(self, name: str) -> torch.Tensor:
        if name in self._next_rows:
            dtype, shape = self._next_rows[name]
            self._landed[name] = torch.empty(shape, dtype=getattr(torch, dtype))
            return self._landed[name]
        return self._blocks_into(name)


class Transfers:
    """A trainer's pulls, push-pulls and row fetches over its :class:`~trainer.transport.Channels`."""

    def __init__(self, channels: Channels, blocks: LocalBlocks):
        self.channels = channels
        self.blocks = blocks

    def pull(self, endpoint: str, min_step: int, blocks_into: Optional[DecodeInto] = None) -> int:
        """``endpoint``'s blocks once it applied ``min_step``, into ``blocks_into`` (default: the
        parameters).

        Returns the pserver's step (updates applied) the answer reflects.
        """
        landing = self.blocks.landing() if blocks_into is None else None
        names = [b.name for b in self.blocks.by_endpoint[endpoint]]
        pserver_step = self.channels[endpoint].pull(
            names, min_step, self.blocks.dtype_and_shape, blocks_into or landing
        )
        if landing is not None:
            landing.install()
        return pserver_step

    def pull_all(
        self,
        min_step: int,
        endpoints: Optional[Sequence[str]] = None,
        blocks_into: Optional[DecodeInto] = None,
    ) -> None:
        """The blocks of ``endpoints`` (default: every pserver's), all pservers in parallel."""
        endpoints = self.blocks.by_endpoint if endpoints is None else endpoints
        self.channels.run_parallel(
            {ep: functools.partial(self.pull, ep, min_step, blocks_into) for ep in endpoints}
        )

    def push_all(self, push: StepPush) -> Dict[str, int]:
        """Push ``push`` to every pserver it goes to, all at once; each answer lands where it says.

        Over data connections already open, this thread sends every request, then reads the answers as
        they arrive (:mod:`trainer.transport.data.started`); the other pushes go in parallel on the channels'
        threads.
        Returns each pserver's step as its answer reported it; a failure is raised once every push ended.
        """
        asked = push.next_batch.rows if push.next_batch is not None else {}

        def rows_asked(ep: str) -> Optional[RowShapes]:
            return asked.get(ep, {}) if ep in push.next_rows else None

        started: Dict[str, Tuple[StartedPush, Optional[Landing]]] = {}
        results: Dict[str, int] = {}
        try:
            sent_later = {}  # the blocks' gradients are read once per pserver: views made each time
            for ep, tensors in push.tensors.items():
                into, _, _, landing = self._answer_target(
                    ep, push.blocks_into, rows_asked(ep), push.next_rows.get(ep)
                )
                call = self.channels[ep].start_push_pull(
                    push.step, tensors, into, push.position, push.step_trainers, push.dropped
                )
                if call is not None:
                    started[ep] = (call, landing)
                else:
                    sent_later[ep] = tensors
            others = {
                ep: functools.partial(
                    self.push_pull,
                    ep,
                    push.step,
                    tensors,
                    push.position,
                    push.blocks_into,
                    rows_asked(ep),
                    push.next_rows.get(ep),
                    step_trainers=push.step_trainers,
                    dropped=push.dropped,
                )
                for ep, tensors in sent_later.items()
            }
            failures = []
            try:
                results.update(self.channels.run_parallel(others))
            except Exception as e:  # noqa: BLE001 - raised once the started pushes ended
                failures.append(e)
            while started:
                ep = answered_first({ep: call for ep, (call, _) in started.items()})
                call, landing = started.pop(ep)
                try:
                    results[ep] = call.finish()
                except Exception as e:  # noqa: BLE001 - raised once the others ended
                    failures.append(e)
                    continue
                if landing is not None:
                    landing.install()
            if failures:
                raise failures[0]
        finally:
            for call, _ in started.values():  # only after an interruption (KeyboardInterrupt): closed unread
                call.abandon()
        return {ep: results[ep] for ep in push.tensors}

    def _answer_target(
        self,
        endpoint: str,
        blocks_into: Optional[DecodeInto],
        next_rows: Optional[RowShapes],
        landed: Optional[Dict[str, torch.Tensor]],
    ) -> Tuple[DecodeInto, DtypeAndShape, int, Optional[Landing]]:
        """Where a push-pull's answer from ``endpoint`` lands (blocks in ``blocks_into``, default: a landing
        of the parameters, installed once the answer is whole; rows asked ahead, ``next_rows``, in new
        tensors in ``landed``): (where, its dtype_and_shape, the answer's tensor bytes, the landing)."""
        landing = self.blocks.landing() if blocks_into is None else None
        into = blocks_into or landing
        dtype_and_shape: DtypeAndShape = self.blocks.dtype_and_shape
        answer_bytes = self.blocks.answer_bytes.get(endpoint, 0)
        if next_rows is not None:
            into = BlocksAndNextRows(self.blocks, into, next_rows, landed)
            dtype_and_shape = into.dtype_and_shape
            answer_bytes += sum(
                math.prod(shape) * DTYPES[dtype].itemsize for dtype, shape in next_rows.values()
            )
        return into, dtype_and_shape, answer_bytes, landing

    def push_pull(
        self,
        endpoint: str,
        step: int,
        tensors: Iterable[Named],
        position: Position,
        blocks_into: Optional[DecodeInto] = None,
        next_rows: Optional[RowShapes] = None,
        landed: Optional[Dict[str, torch.Tensor]] = None,
        during_backward: bool = False,
        step_trainers: Sequence[int] = (),
        dropped: bool = False,
    ) -> int:
        """Push ``step``'s ``tensors`` to ``endpoint``; fresh blocks land in ``blocks_into`` (default: the
        parameters).

        ``next_rows`` / ``landed``: table rows asked ahead with the push, landing in ``landed`` (see
        :class:`BlocksAndNextRows`). ``during_backward``: ``tensors`` come as backward produces them.
        Returns the pserver's step (updates applied) the answer reflects.
        """
        into, dtype_and_shape, answer_bytes, landing = self._answer_target(
            endpoint, blocks_into, next_rows, landed
        )
        pserver_step = self.channels[endpoint].push_pull(
            step,
            tensors,
            dtype_and_shape,
            into,
            position,
            during_backward,
            answer_bytes=None if during_backward else answer_bytes,
            step_trainers=step_trainers,
            dropped=dropped,
        )
        if landing is not None:
            landing.install()
        return pserver_step

    def prefetch_all(self, fetch: RowFetch, min_step: int) -> RowsByPserver:
        """One prefetch round trip per pserver of ``fetch``, in parallel: {pserver: {rows wire name:
        rows}}."""
        return self.channels.run_parallel(
            {ep: functools.partial(self._prefetch, ep, fetch, min_step) for ep in fetch.ids}
        )

    def _prefetch(self, endpoint: str, fetch: RowFetch, min_step: int) -> Dict[str, torch.Tensor]:
        expected = fetch.rows[endpoint]
        rows = self.channels[endpoint].prefetch(min_step, fetch.ids[endpoint], expected.get)
        if rows.keys() != expected.keys():
            raise PserverError(
                endpoint, f"prefetch answer holds {sorted(rows)}, asked for {sorted(expected)}"
            )
        return rows
