"""LocalStepper: a trainer's step that pushes and pulls on its own thread and waits for the answer.

The default stepper (sync mode, and async mode without the pipeline). With
``push_during_backward`` the blocks' pushes open while backward runs
(:class:`~trainer.steppers.overlap.BackwardPush`); ``step()`` then adds the
table gradients and ends the streams. The next batch's table ids ride along
with the push, and their rows come back with its answer.
"""
from __future__ import annotations

from concurrent import futures
from typing import Dict, Iterator, Optional, Tuple

import torch

from transpiler.position import Position

from ..embedding import Pieces
from .base import Prepared, Stepper
from .overlap import BackwardPush

# Per pserver: the table rows asked ahead ({rows wire name: (dtype, shape)}) and where they landed.
Asked = Dict[str, Dict[str, tuple]]
Rows = Dict[str, Dict[str, torch.Tensor]]


class StepPush:
    """One step's push-pull to every pserver, run (and re-run after a failure) by Recovery.heal.

    The first run ends the streams opened during backward, when there are
    any; a retry after a failure sends everything again as a plain push, since
    a stream cannot be replayed.
    """

    def __init__(self, stepper: "LocalStepper", step: int, position: Position, sparse: Pieces, ahead: Pieces,
                 asked: Asked, rows: Rows, streams: Optional[BackwardPush]):
        self.stepper, self.step, self.position = stepper, step, position
        self.sparse, self.ahead, self.asked, self.rows = sparse, ahead, asked, rows
        self.streams = streams

    def __call__(self) -> None:
        s = self.stepper
        if self.streams is not None:
            streams, self.streams = self.streams, None
            streams.finish({ep: self.sparse.get(ep, []) + self.ahead.get(ep, []) for ep in s.push_endpoints})
            return
        # Gathered here: a step whose blocks streamed needs them only to retry.
        grads = s.gradients(self.sparse, self.ahead)
        s.comm.run_parallel({ep: (lambda ep=ep: s.transfers.push_pull(
            ep, self.step, grads[ep], self.position, asked=self.asked.get(ep, {}),
            rows=self.rows.setdefault(ep, {}))) for ep in s.push_endpoints})


class LocalStepper(Stepper):
    """Push-pull every pserver in parallel after backward (or streamed during it); wait for the answers."""

    def __init__(self, *args, push_during_backward: bool = False):
        super().__init__(*args)
        # Streams opened during backward: per pserver, the table rows asked ahead and got.
        self._stream_rows: Dict[str, Tuple[Dict[str, tuple], Dict[str, torch.Tensor]]] = {}
        self.overlap: Optional[BackwardPush] = None
        if push_during_backward:
            self.overlap = BackwardPush(self.blocks, self.model, self.push_endpoints, self._start_stream)

    def step(self, prefetch: Optional[Dict[str, object]], prepared: Prepared) -> None:
        if self._discarded():
            return
        step, position = self.state.step, self.state.next_position()
        sparse = self.tables.take_gradients() if self.program.tables else {}
        plan = self._plan(prefetch, prepared)
        ahead, asked = self.tables.ask_ahead(plan) if plan is not None else ({}, {})
        rows: Rows = {ep: {} for ep in ahead}
        streams = self.overlap if self.overlap is not None and self.overlap.started else None
        if streams is not None:  # the blocks are on their way since backward: the tables join them
            for ep, (stream_asked, stream_rows) in self._stream_rows.items():
                stream_asked.update(asked.get(ep, {}))
                rows[ep] = stream_rows
        push = StepPush(self, step, position, sparse, ahead, asked, rows, streams)
        resync = self.recovery.heal(step, f"step {step}", push, self.transfers.pull_all)
        if ahead and resync is None:
            self.tables.take_ahead(rows)
        # The pushed gradients stay referenced until sent; the next backward makes new ones.
        self.model.zero_grad(set_to_none=True)
        if resync is None:
            self.state.advance(step + 1, position)
        else:
            self.resynced(resync)

    def _start_stream(self, endpoint: str, tensors: Iterator[Tuple[str, torch.Tensor]]) -> futures.Future:
        """Open this step's push to ``endpoint`` fed by ``tensors`` as backward produces them (BackwardPush)."""
        step, position = self.state.step, self.state.next_position()
        asked, rows = self._stream_rows[endpoint] = ({}, {})  # rows asked ahead join at step()
        return self.comm.submit(lambda: self.transfers.push_pull(endpoint, step, tensors, position, asked=asked,
                                                                 rows=rows, streamed=True))

    def _abandon(self) -> None:
        if self.overlap is not None:
            self.overlap.abort()

    def close(self, timeout: Optional[float]) -> None:
        if self.overlap is not None:
            self.overlap.remove()  # the model's hooks go with the trainer
        super().close(timeout)
