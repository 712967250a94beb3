"""Pushes that start during backward: each pserver's stream carries blocks as their gradients appear.

A step's push to a pserver is one client-streamed PushPull call. Instead of
opening it after backward, the trainer opens it when backward produces the
first gradient (a ``post_accumulate_grad`` hook on every parameter) and feeds
each block into its pserver's stream as soon as its parameter's gradient is
final. ``Trainer.step()`` adds the table gradients, ends the streams and
waits for the answers, which only come once a pserver has read its whole
stream: the bytes of a big model travel while backward still runs, as DDP's
bucketed all-reduce does, and the result is exactly that of pushing after
backward.

A parameter whose gradient is accumulated twice in one step (several
backward passes per step) cannot be pushed early: that raises at once, with
the way out (``DistributeTranspilerConfig(push_during_backward=False)``).
Opt-in (``push_during_backward=True``): it pays where the transfer is wire
time; where it is CPU (gRPC Python on few cores) it competes with backward.
"""

from __future__ import annotations

import logging
import queue
from concurrent import futures
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..blocks import LocalBlocks
from ..transport import results_of

log = logging.getLogger(__name__)

_END, _ABORT = object(), object()


class StepAborted(Exception):
    """Raised inside a stream's tensor iterator: gRPC cancels the call, so the pserver counts nothing."""


class BackwardPush:
    """A trainer's pushes that stream each pserver's blocks during backward (see the module doc).

    ``start(endpoint, tensors)`` opens one pserver's call for the current step
    with an iterator of (name, tensor) and returns a future of its answer;
    the trainer binds the step, the data position and where the answer lands.
    """

    def __init__(
        self,
        blocks: LocalBlocks,
        model: torch.nn.Module,
        endpoints: List[str],
        start: Callable[[str, Iterator[Tuple[str, torch.Tensor]]], futures.Future],
    ):
        self._blocks = blocks
        self._endpoints = list(endpoints)
        self._start = start
        self._queues: Optional[Dict[str, queue.Queue]] = None
        self._calls: Dict[str, futures.Future] = {}
        self._done: set = set()
        self.enabled = True
        by_param: Dict[str, list] = {}
        for b in blocks.by_name.values():
            by_param.setdefault(b.param, []).append(b)
        params = dict(model.named_parameters())
        self._handles = [
            params[name].register_post_accumulate_grad_hook(
                lambda p, name=name, bs=tuple(bs): self._ready(name, p, bs)
            )
            for name, bs in by_param.items()
        ]

    @property
    def started(self) -> bool:
        """Whether this step's streams are open (backward produced a gradient since the last step)."""
        return self._queues is not None

    def _ready(self, name: str, param: torch.Tensor, blocks) -> None:
        if not self.enabled:
            return
        if name in self._done:
            self.abort()
            raise RuntimeError(
                f"parameter {name!r} got a second gradient in one step (several backward "
                f"passes before tr.step()?): its blocks were already pushed. Set "
                f"DistributeTranspilerConfig(push_during_backward=False) to accumulate "
                f"gradients over several backward passes"
            )
        self._done.add(name)
        if self._queues is None:
            self._queues = {ep: queue.Queue() for ep in self._endpoints}
            self._calls = {ep: self._start(ep, self._stream(q)) for ep, q in self._queues.items()}
        for b in blocks:
            self._queues[b.endpoint].put((b.name, self._blocks.grad_rows(b)))

    @staticmethod
    def _stream(q: queue.Queue) -> Iterator[Tuple[str, torch.Tensor]]:
        while True:
            item = q.get()
            if item is _END:
                return
            if item is _ABORT:
                raise StepAborted("the trainer abandoned this step's push")
            yield item

    def finish(self, tail: Dict[str, list]) -> Dict[str, object]:
        """End the streams after ``tail`` ({pserver: [(name, tensor)]}, the tables); the answers.

        Re-raises the first failure after every call ended.
        """
        queues, calls = self._queues, self._calls
        self._reset()
        for ep, q in queues.items():
            for item in tail.get(ep, []):
                q.put(item)
            q.put(_END)
        return results_of(calls)

    def abort(self) -> None:
        """Cancel this step's streams (the step is discarded): the pservers count none of them."""
        if self._queues is None:
            return
        queues, calls = self._queues, self._calls
        self._reset()
        for q in queues.values():
            q.put(_ABORT)
        for call in calls.values():
            try:
                call.result()
            except Exception:  # the cancelled call's error is the point
                pass

    def _reset(self) -> None:
        self._queues, self._calls, self._done = None, {}, set()

    def remove(self) -> None:
        """Take the hooks off the model (the trainer closes)."""
        self.abort()
        for h in self._handles:
            h.remove()
        self._handles = []
