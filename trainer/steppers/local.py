"""LocalStepper: a trainer's step that pushes and pulls on its own thread and waits for the answer.

The default stepper (sync mode, and async mode without the pipeline). With
``push_during_backward`` the blocks' pushes open while backward runs
(:class:`~trainer.steppers.overlap.BackwardPush`); ``step()`` then adds the
table gradients and ends the streams. The next batch's table ids ride along
with the push, and their rows come back with its answer.

With backup trainers (``backup_trainers``, sync) a step first claims its
place at the first pserver (:mod:`pserver.engine.services.claims`): admitted, it
pushes its gradients naming the step's trainers; dropped, it pushes nothing
but the next batch's ids, and goes on from the step the pservers stand at
once it applied (no roll-back).
"""

from __future__ import annotations

import functools
from concurrent import futures
from typing import Dict, Iterator, Optional, Tuple

import torch

from ..embedding import RowShapes
from ..errors import MOVED, REFUSED, PserverError, StepMoved
from ..transport import Named
from .overlap import BackwardPush
from .stepper import Stepper, TakeNextPlan
from .transfers import StepPush


class LocalStepper(Stepper):
    """Push-pull every pserver in parallel after backward (or streamed during it); wait for the answers."""

    def __init__(self, *args, push_during_backward: bool = False):
        super().__init__(*args)
        # Streams opened during backward: per pserver, the rows asked ahead (known at step()) and where they
        # land.
        self._stream_rows: Dict[str, Tuple[RowShapes, Dict[str, torch.Tensor]]] = {}
        self.overlap: Optional[BackwardPush] = None
        if push_during_backward:
            self.overlap = BackwardPush(self.blocks, self.model, self.push_endpoints, self._start_stream)

    def step(
        self, prefetch: Optional[Dict[str, object]], take_next_plan: TakeNextPlan, table_grads=None
    ) -> None:
        """:meth:`Stepper.step`; ``table_grads``: a step's table gradients, not yet routed (a step pushed
        again in the job's next layout: :class:`~trainer.errors.StepMoved`), instead of this step's."""
        if self._discarded():
            return
        step, position = self.state.step, self.state.next_position()
        backups = self.program.config.backup_trainers
        claim = self._claim(step) if backups else None
        if claim is False:  # the claim re-synced the trainer elsewhere: this batch's step is gone
            self._forget_batch()
            return
        if table_grads is None:
            table_grads = self.tables.take_table_gradients(clear=False) if self.program.tables else {}
        # Routed before the step is cleared: the lookups' routes of the same ids are reused.
        routed = self.tables.route_gradients(table_grads) if self.program.tables else {}
        if self.program.tables:
            self.tables.clear()
        plan = self._next_plan(prefetch, take_next_plan)
        next_batch = self.tables.ask_next_batch(plan) if plan is not None else None
        try:
            counted = self._push_until_counted(step, position, claim, routed, next_batch)
        except PserverError as e:
            if e.kind != MOVED:
                raise
            raise StepMoved(e, table_grads, step) from None  # pushed again, unrouted, in the next layout
        if counted is None:  # re-claimed elsewhere: this batch's step is gone
            return
        resync, pserver_steps, next_rows, dropped = counted
        if next_batch is not None and resync is None:
            self.tables.take_next_batch_rows(next_rows)
        # The pushed gradients stay referenced until sent; the next backward makes new ones.
        self.clear_grads()
        if resync is not None:
            self.resynced(resync)
        elif dropped:  # on from where the pservers stand: past this step, and maybe past later ones
            self.state.advance(max(step + 1, min(pserver_steps.values(), default=step + 1)), position)
        else:
            self.state.advance(step + 1, position)

    def _push_until_counted(self, step: int, position, claim, routed, next_batch):
        """Push ``step`` until it counts (backup trainers: claimed again while its set left); (the decision
        that moved the trainer or None, the pservers' steps, the next batch's rows, whether it was
        dropped), or None if the step is gone (re-claimed elsewhere)."""
        decider = self.program.pservers[0]
        while True:
            dropped = claim is not None and not claim.admitted
            resync, pserver_steps, next_rows = self._push_step(
                step, position, claim, dropped, routed, next_batch
            )
            if not (dropped and resync is None and min(pserver_steps.values(), default=step + 1) <= step):
                break
            # Answered with the step unapplied: every trainer of its set left before pushing it there.
            if pserver_steps.get(decider, step) > step:
                # The first pserver applied it with their pushes; a pserver that counts none of them
                # cannot complete it (as in plain sync, a trainer died between its pushes).
                raise PserverError(
                    decider,
                    f"step {step}: its trainers {list(claim.trainers)} left after pushing it to some "
                    f"pservers but not to {[ep for ep, s in pserver_steps.items() if s <= step]}, which "
                    f"cannot complete it (docs/modes.md, backup trainers)",
                    REFUSED,
                )
            # The step is claimed again among the live trainers (docs/modes.md, backup trainers); a
            # first pserver that has not yet dropped them answers as before, and this push waits there.
            claim = self._claim(step)
            if claim is False:
                self._forget_batch()
                return None
        return resync, pserver_steps, next_rows, dropped

    def _forget_batch(self) -> None:
        """Drop this batch's gradients and looked-up rows: its step is gone (the trainer re-synced)."""
        self.tables.clear()
        self.clear_grads()

    def _push_step(self, step: int, position, claim, dropped: bool, table_grads, next_batch):
        """Push ``step`` to every pserver (with the next batch's ids; backup trainers: ``dropped`` with no
        gradients, or naming the set ``claim`` admitted it to); (the decision that moved the trainer or
        None, the pservers' steps, the next batch's rows by pserver)."""
        next_ids = next_batch.ids if next_batch is not None else {}
        streams = self.overlap if self.overlap is not None and self.overlap.started else None
        if dropped:  # no gradients: the next batch's ids alone
            tensors = {ep: next_ids.get(ep, []) for ep in self.push_endpoints}
        else:
            tensors = self.push_tensors(table_grads, next_ids)
        next_rows = {ep: {} for ep in self.push_endpoints}
        first = None
        if streams is not None:  # the blocks are on their way since backward: the tables join them
            for ep, (stream_asked, stream_landed) in self._stream_rows.items():
                stream_asked.update(next_batch.rows.get(ep, {}) if next_batch is not None else {})
                next_rows[ep] = stream_landed
            first = functools.partial(streams.finish, tensors.tail)
        admitted = tuple(claim.trainers) if claim is not None and claim.admitted else ()
        push = StepPush(
            step, position, tensors, next_batch, next_rows, step_trainers=admitted, dropped=dropped
        )
        resync, pserver_steps = self.push(push, first)
        return resync, pserver_steps, next_rows

    def _claim(self, step: int):
        """Backup trainers: the first pserver's verdict on this trainer's ``step`` (ClaimReply); False if
        healing the call moved the trainer to another step (re-synced here)."""
        verdict = []
        decider = self.program.pservers[0]
        outcome = self._heal(
            step, f"claim of step {step}", lambda: verdict.append(self.channels[decider].claim(step))
        )
        if outcome is not None:
            self.resynced(outcome)
            return False
        return verdict[-1]

    def _start_stream(self, endpoint: str, tensors: Iterator[Named]) -> futures.Future:
        """Open this step's push to ``endpoint`` fed by ``tensors`` as backward produces them
        (BackwardPush)."""
        step, position = self.state.step, self.state.next_position()
        asked, landed = self._stream_rows[endpoint] = ({}, {})  # rows asked ahead join at step()
        return self.channels.submit(
            functools.partial(
                self.transfers.push_pull,
                endpoint,
                step,
                tensors,
                position,
                None,
                asked,
                landed,
                during_backward=True,
            )
        )

    def _abandon(self) -> None:
        if self.overlap is not None:
            self.overlap.abort()

    def close(self, timeout: Optional[float]) -> None:
        if self.overlap is not None:
            self.overlap.remove()  # the model's hooks go with the trainer
        super().close(timeout)
