"""PipelinedStepper: async mode's pipeline, where a step's push-pull goes on while the next batch trains.

``step()`` hands the push to a background thread and returns at once; the
blocks it pulls wait in :class:`~trainer.blocks.LocalBlocks`' staging
buffers and are installed by the next ``step()`` (or ``pull()``,
``close()``), so a trainer computes on parameters one step staler than
without the pipeline. The next batch's table rows are fetched on the feed's
thread while the current batch trains (``read_ahead``), once the push before
it is answered: rows one step stale too, never two.
"""

from __future__ import annotations

from concurrent import futures
from typing import Dict, Optional

from ..embedding import NextBatchPlan
from .stepper import Stepper, TakeNextPlan
from .transfers import StepPush


class PipelinedStepper(Stepper):
    """Async only: push-pull in the background; the pulled blocks are installed by the next step."""

    def __init__(self, *args):
        super().__init__(*args)
        self._sender = futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-send")
        self._in_flight: Optional[futures.Future] = None

    def step(self, prefetch: Optional[Dict[str, object]], take_next_plan: TakeNextPlan) -> None:
        if self._discarded():
            return
        step, position = self.state.step, self.state.next_position()
        self.flush()  # before the pinned gradient buffers (CUDA) are refilled
        table_grads = self.tables.take_gradients() if self.program.tables else {}
        plan = self._next_plan(prefetch, take_next_plan)
        # The next forward runs before this push is answered: its rows were fetched ahead
        # while this batch trained (read_ahead), or its lookups fetch them.
        # Async only: recovery retries, never moves the trainer (see trainer.recovery.decide).
        # Gathered now, on this thread: the sender reads them while the next batch trains.
        push = StepPush(
            step, position, dict(self.push_tensors(table_grads, {})), blocks_into=self.blocks.stage
        )
        self._in_flight = self._sender.submit(self.push, push)
        if plan is not None:
            self.tables.install_next_batch(plan)
        # The pushed gradients stay referenced until sent; the next backward makes new ones.
        self.clear_grads()
        self.state.advance(step + 1, position)

    def plan_next_batch(self, ids: Dict[str, object]) -> NextBatchPlan:
        """The next batch's ids deduplicated and routed, and its rows fetched once the push sent before the
        batch now training is answered.

        The next step computes on the blocks that push brings back (one step stale); rows fetched while
        it was still in flight would miss it too, two steps stale, as often as the fetch wins the race.
        ``step()`` sends the current batch's push only after this plan is made, so the push in flight
        here is always the one before it.
        """
        sent = self._in_flight
        if sent is not None:
            futures.wait([sent])  # bounded by the push's own deadlines; its failure is flush()'s to raise
        return self.tables.plan_next_batch(ids, self.transfers.prefetch_all)

    def flush(self) -> None:
        """Wait for the step sent in the background; install the parameters it pulled."""
        sent = self._in_flight
        if sent is None:
            return
        try:
            sent.result()  # re-raises the push's PserverError here, on the caller's thread
        finally:
            self._in_flight = None  # only now: until it is answered, plan_next_batch waits for it
        self.blocks.install_staged()

    def close(self, timeout: Optional[float]) -> None:
        self._sender.shutdown(wait=False)
        super().close(timeout)
