"""Reductions: trainers' global metrics, combined on one pserver (sum, max or min over every live trainer).

Trainers in pserver mode cannot reach each other, so a global metric (the
loss over all trainers' data, AUC from every trainer's score histograms) goes
through a pserver: each trainer sends its local values for a ``(key, round)``,
and once every live trainer has, the pserver combines them and answers each
with the same result. Values are combined in float64, in ascending trainer id
order: counts (histogram buckets, instances) are exact up to 2**53, and every
trainer gets the very same bits.

A round is finished once the trainers that the engine still expects (not
closed, not dropped) have all sent theirs; a trainer that closed first is not
waited for. Each key keeps its latest finished round, so a retried call gets
the answer again.

:class:`Rounds` is the bookkeeping (pure, not thread-safe); :class:`Reductions`
the service the RPC layer calls, with its own lock, deadline and wake-ups. It
shares no lock with the engine: it asks the engine which trainers it expects,
and the engine tells it when that may have changed.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import numpy as np

from ...errors import BadRequest, NotAllowed
from ..waits import Parked, Waits

OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}
# Rounds open at once, over all keys: bounds what a misbehaving trainer can make a pserver hold.
MAX_OPEN = 64
MAX_KEY_CHARS = 200

Values = Dict[str, np.ndarray]
Combined = Tuple[Values, Tuple[int, ...]]  # the values and the trainers they came from


def to_values(items: Iterable[Tuple[str, Sequence[int], Sequence[float]]]) -> Values:
    """``[(name, shape, data)]`` as float64 arrays; BadRequest for a missing or repeated name or a wrong
    length."""
    values: Values = {}
    for name, shape, data in items:
        if not name:
            raise BadRequest("a reduced value needs a name")
        if name in values:
            raise BadRequest(f"reduced value {name!r} is sent twice")
        shape = tuple(int(d) for d in shape)
        if any(d < 0 for d in shape):
            raise BadRequest(f"reduced value {name!r} has a negative dimension in shape {list(shape)}")
        size = math.prod(shape)
        if len(data) != size:
            raise BadRequest(
                f"reduced value {name!r} of shape {list(shape)} needs {size} numbers, got {len(data)}"
            )
        values[name] = np.asarray(data, dtype=np.float64).reshape(shape)
    if not values:
        raise BadRequest("a reduction needs at least one value")
    return values


def combine(op: str, parts: Mapping[int, Values]) -> Values:
    """Combine every trainer's values by ``op`` in ascending trainer id order, in float64."""
    ufunc = OPS[op]
    ids = sorted(parts)
    out = {name: np.array(v, dtype=np.float64) for name, v in parts[ids[0]].items()}
    for t in ids[1:]:
        for name, v in parts[t].items():
            ufunc(out[name], v, out=out[name])
    return out


def _shapes(values: Values) -> Dict[str, tuple]:
    return {name: v.shape for name, v in values.items()}


@dataclass
class Round:
    """One open reduction: its op, the shapes every trainer must send, and the values sent so far."""

    op: str
    shapes: Dict[str, tuple]
    parts: Dict[int, Values]


class Rounds:
    """The open and latest finished rounds of every key on one pserver (not thread-safe: see
    :class:`Reductions`)."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.open: Dict[Tuple[str, int], Round] = {}
        # Per key, its latest finished round: (round, combined values, contributors).
        self.done: Dict[str, Tuple[int, Values, Tuple[int, ...]]] = {}

    def add(self, trainer_id: int, key: str, round_: int, op: str, values: Values) -> None:
        """Take ``trainer_id``'s values for ``(key, round_)``; a refusal changes nothing.

        Sending again to a round still open replaces the values (a retry). A
        round already finished with this trainer in it is answered from
        :meth:`result`; one finished without it, or an older one, is refused.
        """
        if not key or len(key) > MAX_KEY_CHARS:
            raise BadRequest(f"a reduction key must have 1 to {MAX_KEY_CHARS} characters, got {len(key)}")
        if op not in OPS:
            raise BadRequest(f"reduction op must be one of {sorted(OPS)}, got {op!r}")
        if round_ < 0:
            raise BadRequest(f"reduction round must be >= 0, got {round_}")
        done = self.done.get(key)
        if done is not None and round_ <= done[0]:
            if round_ == done[0] and trainer_id in done[2]:
                return
            raise NotAllowed(
                f"pserver {self.endpoint}: round {round_} of reduction {key!r} from trainer "
                f"{trainer_id} is over (round {done[0]} finished with trainers {list(done[2])}); "
                f"a trainer that restarted counts its rounds from 0 again: pass round= explicitly"
            )
        r = self.open.get((key, round_))
        if r is None:
            if len(self.open) >= MAX_OPEN:
                raise NotAllowed(
                    f"pserver {self.endpoint}: {MAX_OPEN} reductions are open already; "
                    f"trainers must reduce the same keys in the same order"
                )
            self.open[(key, round_)] = Round(op, _shapes(values), {trainer_id: values})
            return
        if r.op != op:
            raise BadRequest(
                f"trainer {trainer_id} asks for {op!r} in round {round_} of reduction {key!r}, "
                f"others for {r.op!r}"
            )
        if _shapes(values) != r.shapes:
            raise BadRequest(
                f"trainer {trainer_id} sends {_describe(values)} in round {round_} of reduction "
                f"{key!r}, others sent {_describe_shapes(r.shapes)}"
            )
        r.parts[trainer_id] = values

    def result(self, key: str, round_: int, expected: set) -> Optional[Combined]:
        """The combined values of ``(key, round_)`` once every trainer in ``expected`` sent its own; else
        None."""
        done = self.done.get(key)
        if done is not None and done[0] == round_:
            return done[1], done[2]
        r = self.open[(key, round_)]
        if not expected <= r.parts.keys():
            return None
        values, contributors = combine(r.op, r.parts), tuple(sorted(r.parts))
        del self.open[(key, round_)]
        self.done[key] = (round_, values, contributors)
        return values, contributors

    def missing(self, key: str, round_: int, expected: set) -> List[int]:
        """The trainers of ``expected`` that have not sent ``(key, round_)`` yet."""
        r = self.open.get((key, round_))
        return sorted(expected - (r.parts.keys() if r else set()))

    def withdraw(self, trainer_id: int, key: str, round_: int) -> None:
        """A caller gave up (deadline, shutdown): its values leave the round, and an empty round goes."""
        r = self.open.get((key, round_))
        if r is not None:
            r.parts.pop(trainer_id, None)
            if not r.parts:
                del self.open[(key, round_)]


class Reductions:
    """The Reduce service of one pserver: each trainer's values for a ``(key, round)``, combined once all
    are in.

    ``expected()`` gives the trainers a round waits for (the engine's live trainers: neither closed nor
    dropped); ``admit(trainer_id)`` raises the refusal for a trainer that may not take part (closed:
    NotAllowed; dropped: MustResync). The engine calls :meth:`roster_changed` whenever that set may have
    changed, so a pending round finishes (or times out) without waiting for a trainer that left.
    ``released(trainer_id)`` hears of each trainer whose wait for a round completed (the engine's
    ``touch``): the round held its call until now, so that is when it was last heard from.

    Lock order: this service calls ``expected()`` holding its own lock, so the engine must call
    :meth:`roster_changed` after releasing its lock, never under it (else each would wait for the other).
    """

    def __init__(
        self,
        endpoint: str,
        barrier_timeout: float,
        expected: Callable[[], AbstractSet[int]],
        admit: Callable[[int], None],
        released: Optional[Callable[[int], object]] = None,
    ):
        self.endpoint = endpoint
        self.barrier_timeout = barrier_timeout
        self._expected = expected
        self._admit = admit
        self._cv = threading.Condition()
        self._rounds = Rounds(endpoint)
        self._waits = Waits(self._cv, endpoint, barrier_timeout, released=released)

    def park(
        self, trainer_id: int, key: str, round_: int, op: str, values: Values
    ) -> Tuple[Parked, Callable[[], Combined]]:
        """Add ``values`` to ``(key, round_)``: the wait for the round (see :mod:`..waits`) and its result,
        once done.

        The round finishes once every expected trainer sent its values (not closed or dropped ones); after
        ``barrier_timeout`` the wait fails with BarrierTimeout naming those missing, and this trainer's
        values leave the round (as on ShuttingDown). A closed or dropped caller is refused before its
        values count.
        """
        self._admit(trainer_id)
        with self._cv:
            self._rounds.add(trainer_id, key, round_, op, values)
            found: List[Combined] = []

            def finished() -> bool:
                combined = self._rounds.result(key, round_, self._expected())
                if combined is not None:
                    found.append(combined)
                return combined is not None

            def withdraw(handle: Parked) -> None:
                if handle.error is not None:
                    self._rounds.withdraw(trainer_id, key, round_)

            handle = self._waits.park(
                finished,
                f"round {round_} of reduction {key!r}",
                lambda: self._rounds.missing(key, round_, self._expected()),
                trainer=trainer_id,
            )
            handle.add_callback(withdraw)
            if handle.done:
                self._waits.notify()  # the others waiting for this round find it finished
            return handle, lambda: found[-1]

    def reduce(self, trainer_id: int, key: str, round_: int, op: str, values: Values) -> Combined:
        """Combine ``values`` with those of every expected trainer for ``(key, round_)``; (result,
        contributors).

        Blocks on :meth:`park`'s wait: the same rules, for in-process callers.
        """
        handle, result = self.park(trainer_id, key, round_, op, values)
        with self._cv:
            self._waits.block(handle)
        handle.finish()
        return result()

    def roster_changed(self) -> None:
        """Wake the pending rounds to look again at who is expected (a trainer closed, was dropped or
        rejoined)."""
        with self._cv:
            self._waits.notify()

    def parked_trainers(self) -> Set[int]:
        """The trainers whose Reduce waits for a round now."""
        with self._cv:
            return self._waits.parked_trainers()

    def open_rounds(self) -> List[Tuple[str, int]]:
        """The ``(key, round)`` pairs waiting for trainers now, sorted (for tests and operators)."""
        with self._cv:
            return sorted(self._rounds.open)

    def stop(self) -> None:
        """Refuse every pending and later round with ShuttingDown, so the server can shut down."""
        with self._cv:
            self._waits.stop()


def _describe(values: Values) -> str:
    return _describe_shapes(_shapes(values))


def _describe_shapes(shapes: Mapping[str, tuple]) -> str:
    return ", ".join(f"{name} {list(shape)}" for name, shape in sorted(shapes.items()))
