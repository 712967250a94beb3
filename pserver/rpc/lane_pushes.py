"""LanePushes: a push split across several calls (lanes) made whole before the engine counts it.

A trainer with ``push_lanes`` > 1 sends one step's push-pull to a pserver as
``lanes`` calls at once, each over its own connection (:mod:`psproto.lane_blocks`):
call ``lane`` carries the gradients of its share of the blocks (and, in lane 0,
the tables' tensors) and is answered with that share. Each call is read and
checked on its own, then held here; the call that brings the last lane pushes
the whole to the engine, once, and the others park until it has. Every lane
answers with what that push gave: counted or a duplicate, or the error it
raised. Whether a push counts is the engine's to say, never this module's: a
retried attempt is made whole again and pushed again (the engine acknowledges a
duplicate; after a roll-back, it counts the step anew).

Held per trainer: at most one push, the latest attempt's (a lane of a newer
attempt drops a push that never became whole, releasing its buffers; a late lane
of an older attempt, one its trainer cancelled, is refused). A
lane whose partners never come waits at most ``barrier_timeout``, as any wait
does, naming its trainer; a roll-back ends its wait as it ends every wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

from psproto.lane_blocks import MAX_LANES, lane_of_blocks

from ..engine.waits import Parked, Waits
from ..errors import BadRequest, Refusal
from .parking import park

# (dense gradients by block, sparse gradients by table) of one lane, or of the whole push
Gradients = Tuple[Dict[str, object], Dict[str, object]]
# (session, number): which attempt of a push a lane belongs to; numbers rise within a session
Attempt = Tuple[str, int]


class _Push:
    """One trainer's push of ``step`` as its lanes arrive; changed only under the engine's lock."""

    def __init__(self, step: int, lanes: int, attempt: Attempt):
        self.step = step
        self.lanes = lanes
        self.attempt = attempt
        self.parts: Dict[int, Tuple[Gradients, dict]] = {}  # lane -> (gradients, buffers)
        self.taken = False  # whole, and handed to the engine by the lane that completed it
        self.done = False  # the engine answered (``counted``) or raised (``error``), or it was dropped
        self.counted = False
        self.error: Optional[BaseException] = None

    def hold(self, lane: int, gradients: Gradients, buffers: dict) -> Optional[dict]:
        """Hold one lane's part; the buffers of an earlier copy of the same lane, which it replaces."""
        earlier = self.parts.get(lane)
        self.parts[lane] = (gradients, buffers)
        return earlier[1] if earlier is not None else None

    def take(self) -> Optional[Dict[int, Gradients]]:
        """Once every lane came: their gradients, handed out once (the push is taken); else None."""
        if len(self.parts) < self.lanes:
            return None
        self.taken = True
        return {lane: g for lane, (g, _) in self.parts.items()}

    def end(self, counted: bool = False, error: Optional[BaseException] = None) -> List[dict]:
        """The push is over (answered, refused or dropped); the buffers to release."""
        buffers = [b for _, b in self.parts.values()]
        self.parts = {}
        self.done, self.counted, self.error = True, counted, error
        return buffers


@dataclass
class Ticket:
    """What :meth:`LanePushes.add` gives one lane's call.

    ``whole``: this lane completed the push: the merged gradients, for the
    caller to push and then report with :meth:`LanePushes.finish`. Else
    ``wait``: the handle to park on, after which :meth:`LanePushes.outcome`
    says whether the push was counted (False: a duplicate).
    """

    push: _Push
    whole: Optional[Gradients] = None
    wait: Optional[Parked] = None


def merge(parts: Dict[int, Gradients]) -> Gradients:
    """The lanes' gradients as one push's; a block or table sent in two lanes is refused."""
    dense: Dict[str, object] = {}
    sparse: Dict[str, object] = {}
    for lane in sorted(parts):
        part_dense, part_sparse = parts[lane]
        for into, part in ((dense, part_dense), (sparse, part_sparse)):
            twice = sorted(set(into) & set(part))
            if twice:
                raise BadRequest(f"a push split across lanes carries {twice[:3]} in more than one lane")
            into.update(part)
    return dense, sparse


class LanePushes:
    """Every trainer's push in lanes, held until whole (see the module doc); one per pserver.

    ``waits``: the engine's (its lock guards what is held here too);
    ``release``: gives a lane's buffers back once its push is done with them;
    ``blocks``: this pserver's blocks and their bytes, in plan order.
    """

    def __init__(self, waits: Waits, release: Callable[[dict], None], blocks: Dict[str, int]):
        self._waits = waits
        self._release = release
        self._blocks = dict(blocks)
        self._lane_of: Dict[int, Dict[str, int]] = {}
        self._lane_blocks: Dict[int, List[List[str]]] = {}  # lanes -> each lane's blocks, in plan order
        self._held: Dict[int, _Push] = {}

    def lane_of(self, lanes: int) -> Dict[str, int]:
        """Which lane carries each block when a push-pull comes in ``lanes`` lanes
        (:mod:`psproto.lane_blocks`)."""
        lane_of = self._lane_of.get(lanes)
        if lane_of is None:
            if not 1 < lanes <= MAX_LANES:
                raise BadRequest(f"a push split across {lanes} lanes (2 to {MAX_LANES})")
            lane_of = self._lane_of[lanes] = lane_of_blocks(self._blocks.items(), lanes)
            self._lane_blocks[lanes] = [[n for n in self._blocks if lane_of[n] == k] for k in range(lanes)]
        return lane_of

    def blocks_of(self, lane: int, lanes: int) -> List[str]:
        """The blocks lane ``lane`` of ``lanes`` carries and is answered with, in plan order (computed
        once)."""
        self.lane_of(lanes)
        return self._lane_blocks[lanes][lane]

    def add(
        self,
        trainer: int,
        step: int,
        lane: int,
        lanes: int,
        gradients: Gradients,
        buffers: dict,
        attempt: Attempt = ("", 0),
    ) -> Ticket:
        """Hold lane ``lane`` of ``lanes`` of ``trainer``'s push of ``step``; what the call does next
        (:class:`Ticket`).

        ``buffers``: the lane's received tensors, owned from now on (released once the push is done with
        them, or at once if the lane is refused). ``attempt``: (session, number) of the attempt the lane
        belongs to. A lane of an older attempt of the same session than the one held is refused: its
        trainer cancelled it, and it must not make a newer attempt's push whole (and leave that attempt's
        own lane waiting for partners that already went).
        """
        try:
            self.lane_of(lanes)
            if not 0 <= lane < lanes:
                raise BadRequest(f"lane {lane} of a push split across {lanes} lanes")
        except BadRequest:
            self._release(buffers)
            raise
        dropped = []
        try:
            with self._waits.cv:
                push = self._held.get(trainer)
                if push is not None and push.attempt[0] == attempt[0] and attempt[1] < push.attempt[1]:
                    dropped.append(buffers)
                    raise Refusal(
                        f"lane {lane} of trainer {trainer}'s attempt {attempt[1]} at step {step} came "
                        f"after attempt {push.attempt[1]}: dropped"
                    )
                if (
                    push is None
                    or push.taken
                    or (push.attempt, push.step, push.lanes) != (attempt, step, lanes)
                ):
                    if push is not None and not push.taken:  # never whole: its parked lanes end
                        dropped += push.end(
                            error=Refusal(
                                f"trainer {trainer}'s push of step {push.step} was "
                                f"replaced by another attempt before all its lanes came"
                            )
                        )
                        self._waits.notify()
                    push = self._held[trainer] = _Push(step, lanes, attempt)
                earlier = push.hold(lane, gradients, buffers)
                if (
                    earlier is not None
                ):  # the same lane again (a retry before the push was whole): the newer copy
                    dropped.append(earlier)
                parts = push.take()
                if parts is None:
                    return Ticket(push, wait=self._park(trainer, push))
            try:
                return Ticket(push, whole=merge(parts))
            except BadRequest as e:
                self.finish(push, error=e)
                raise
        finally:
            for b in dropped:
                self._release(b)

    def _park(self, trainer: int, push: _Push) -> Parked:
        """Under the lock: a wait for ``push`` to be answered."""
        return self._waits.park(
            lambda: push.done,
            f"lanes of trainer {trainer}'s push of step {push.step}",
            lambda: [trainer],
            trainer=trainer,
        )

    def settle(self, ticket: Ticket, push_whole: Callable[..., Iterator]) -> Iterator:
        """``counted = yield from settle(...)``: the lane that completed its push pushes it with
        ``push_whole(dense, sparse)`` (a parking generator) and reports it; any other parks until it did."""
        if ticket.whole is None:
            yield from park(ticket.wait)
            return self.outcome(ticket)
        try:
            counted = yield from push_whole(*ticket.whole)
        except BaseException as e:  # GeneratorExit too: the call went away while its push waited (staleness)
            self.finish(
                ticket.push,
                error=e
                if isinstance(e, Exception)
                else Refusal(
                    f"the call that made the push of step {ticket.push.step} whole went away before it "
                    "counted"
                ),
            )
            raise
        self.finish(ticket.push, counted=counted)
        return counted

    def finish(self, push: _Push, counted: bool = False, error: Optional[BaseException] = None) -> None:
        """The engine answered ``push`` (``counted``) or raised ``error``: its parked lanes go on; buffers
        released."""
        with self._waits.cv:
            buffers = push.end(counted, error)
            self._waits.notify()
        for b in buffers:
            self._release(b)

    @staticmethod
    def outcome(ticket: Ticket) -> bool:
        """Once a waiting lane's push was answered: whether it was counted (False: a duplicate); raises its
        error."""
        if ticket.push.error is not None:
            raise ticket.push.error
        return ticket.push.counted

    def held(self) -> int:
        """Trainers with a push held here (bounded by the trainers)."""
        with self._waits.cv:
            return sum(1 for p in self._held.values() if not p.done)
