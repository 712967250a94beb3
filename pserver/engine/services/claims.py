"""StepClaims: with backup trainers, which trainers' pushes make each sync step, decided on the first pserver.

With ``backup_trainers`` b of N trainers, a trainer that finished a step's
backward *claims* the step at the first pserver before pushing. The first
``min(N - b, live)`` claims make the step's set of trainers; each of them
pushes its gradients with the set (``PushHeader.step_trainers``), so every
pserver waits for exactly those trainers and applies the same mean; a trainer
that claims later is told it was dropped, pushes nothing for the step and
goes on from where the step leaves the job. The decision is one pserver's, so
pservers never mix trainer sets within a step.

A set, once made, stays the step's for :data:`KEEP` steps: a step redone after
a roll-back is made of the same trainers again. A claim of a step decided too
long ago (the pservers applied it already) is a straggler's: dropped. A first
pserver that restarted learns the set of a step in progress from the pushes
retried to it (:meth:`StepClaims.learn`), so later claims of it agree.

Under hot standby every set is handed to ``on_made`` (the replication stream) as it is made, under this
service's lock, and a claim is answered only once the backup holds it (the Claim call waits for the
backup's acknowledgement as a push's answer does): a primary lost mid-step loses no set a trainer was
told, and its backup, leading, gives every later claim of the step the same set
(:meth:`StepClaims.learn_all`). A joining backup gets the sets made before it as one message
(:meth:`StepClaims.replicate_all`).

Rules: :func:`verdict` and :func:`full`, pure and table-tested; the service
holds the claims under its own lock and parks a claim until its step's set is
made (``barrier_timeout``), like :mod:`.reductions`. Memory: at most
:data:`KEEP` sets of at most N trainer ids, and the claims of the steps open.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import AbstractSet, Callable, Dict, Mapping, Optional, Sequence, Set, Tuple

from ..rollback import RollBacks
from ..waits import Parked, Waits

log = logging.getLogger(__name__)

# Steps whose trainer sets are remembered (those a roll-back may redo are recent ones).
KEEP = 4096
# The latest sets looked at for a step whose trainers all left (the steps in progress are among them).
RECENT = 64


@dataclass(frozen=True)
class Verdict:
    """What a claim learns: whether the trainer's push counts, and the step's trainers (sorted)."""

    admitted: bool
    trainers: Tuple[int, ...]


def verdict(
    step: int, trainer_id: int, made: Mapping[int, Tuple[int, ...]], applied: int
) -> Optional[Verdict]:
    """The verdict on ``trainer_id``'s claim of ``step`` now, or None: the step is open and the claim counts.

    ``made``: the steps whose sets are made; ``applied``: the steps the deciding pserver applied.
    """
    if step in made:
        return Verdict(trainer_id in made[step], made[step])
    if step < applied:  # decided and forgotten: this trainer is that far behind
        return Verdict(False, ())
    return None


def abandoned(
    step: int, trainers: AbstractSet[int], live: AbstractSet[int], applied: int, counted: Callable[[], bool]
) -> bool:
    """Whether ``step``'s set ``trainers`` is forgotten and the step claimed again: none of them is live any
    more (each closed or was dropped for silence), the step is not applied, and no push of it counted on the
    deciding pserver (``counted()``, asked last: it takes the engine's lock). Then no pserver can complete
    the step with that set, whose trainers will not push it."""
    return step >= applied and not (trainers & live) and not counted()


def full(claimed: int, live: int, needed: int) -> bool:
    """Whether a step with ``claimed`` claims is made: ``needed`` (N - b) of them, or every live trainer's."""
    return claimed >= max(1, min(needed, live))


class StepClaims:
    """The first pserver's claims service (see the module doc).

    ``on_made(sets)``: told, under this service's lock, of each set as it is made or learnt ({step:
    trainers}; hot standby replicates them). ``live()``: the trainers a step may wait for (the
    engine's: neither closed nor dropped); ``applied()``: the steps the engine applied; ``admit(trainer_id)``
    raises the refusal for a trainer that may not claim (closed or dropped).
    The engine calls :meth:`roster_changed` (outside its own lock) when the
    live set may have shrunk, so a step waiting for claims is made without
    the trainers that left, and after a roll-back: a claim from before it
    (``rollbacks``, the engine's) then ends with MustResync, as the engine's
    own waits do, unless its step's set is made.
    """

    def __init__(
        self,
        endpoint: str,
        trainers: int,
        backups: int,
        barrier_timeout: float,
        live: Callable[[], AbstractSet[int]],
        applied: Callable[[], int],
        admit: Callable[[int], None],
        rollbacks: Optional[RollBacks] = None,
        released: Optional[Callable[[int], object]] = None,
        on_made: Callable[[Mapping[int, Tuple[int, ...]]], None] = lambda sets: None,
        counted: Callable[[int], bool] = lambda step: False,
    ):
        self.endpoint = endpoint
        self._on_made, self._counted = on_made, counted
        self.needed = trainers - backups
        self._live, self._applied, self._admit = live, applied, admit
        self._cv = threading.Condition()
        self._waits = Waits(self._cv, endpoint, barrier_timeout, rollbacks=rollbacks, released=released)
        self._open: Dict[int, Set[int]] = {}
        self._made: "OrderedDict[int, Tuple[int, ...]]" = OrderedDict()

    def park(self, trainer_id: int, step: int) -> Tuple[Parked, Callable[[], Verdict]]:
        """Claim ``step`` for ``trainer_id``: the wait until its set is made, and then the verdict."""
        self._admit(trainer_id)
        with self._cv:
            self._forget_abandoned()
            if verdict(step, trainer_id, self._made, self._applied()) is None:
                self._open.setdefault(step, set()).add(trainer_id)
                self._make_full()
            handle = self._waits.park(
                lambda: verdict(step, trainer_id, self._made, self._applied()) is not None,
                f"the trainers of step {step}",
                lambda: sorted(self._live() - self._open.get(step, set())),
                trainer=trainer_id,
            )
            if handle.done:
                self._waits.notify()  # the others that claimed this step find it made
            return handle, lambda: verdict(step, trainer_id, self._made, self._applied())

    def claim(self, trainer_id: int, step: int) -> Verdict:
        """:meth:`park`'s verdict, blocking: for in-process callers."""
        handle, result = self.park(trainer_id, step)
        with self._cv:
            self._waits.block(handle)
        handle.finish()
        return result()

    def _make_full(self) -> None:
        """Make every open step that has its claims (under the lock)."""
        live = len(self._live())
        made = {
            step: tuple(sorted(claimed))
            for step, claimed in self._open.items()
            if full(len(claimed), live, self.needed)
        }
        for step, trainers in made.items():
            del self._open[step]
            self._keep(step, trainers)
        if made:
            self._on_made(made)

    def _forget_abandoned(self) -> None:
        """Forget the set of every step in progress whose trainers all left before pushing it
        (:func:`abandoned`; under the lock): the live trainers claim it again."""
        live, applied, gone = self._live(), self._applied(), {}
        # The steps in progress are among the sets made or learnt last (a set learnt from a retried push may
        # be an older step's, so the latest few are looked at, not only those before the first applied).
        for step in itertools.islice(reversed(self._made), RECENT):
            if abandoned(step, set(self._made[step]), live, applied, lambda: self._counted(step)):
                gone[step] = ()
        for step in gone:
            log.warning(
                "%s: every trainer of step %d's set %s left before pushing it; the step is claimed again",
                self.endpoint,
                step,
                list(self._made.pop(step)),
            )
        if gone:
            self._on_made(gone)  # an empty set: forgotten (learn_all)

    def _keep(self, step: int, trainers: Tuple[int, ...]) -> None:
        """Remember ``step``'s set (under the lock), forgetting the oldest past :data:`KEEP`."""
        self._made[step] = trainers
        self._made.move_to_end(step)
        while len(self._made) > KEEP:
            self._made.popitem(last=False)

    def learn(self, step: int, trainers) -> None:
        """A push names ``step``'s trainers: keep them if this process does not know the step's set (it
        restarted after making it), so that later claims of the step get the set the pushes carry."""
        self.learn_all({step: trainers})

    def learn_all(self, sets: Mapping[int, Sequence[int]]) -> None:
        """:meth:`learn` of several steps' sets ({step: trainers}): also a backup's, from its primary,
        where an empty set says the step's set was forgotten (:meth:`_forget_abandoned`)."""
        with self._cv:
            for s in [int(s) for s, ts in sets.items() if not ts]:
                self._made.pop(s, None)
            new = {
                int(s): tuple(sorted(int(t) for t in ts))
                for s, ts in sets.items()
                if ts and int(s) not in self._made
            }
            for step, trainers in sorted(new.items()):
                self._keep(step, trainers)
                self._open.pop(step, None)
            if new:
                self._on_made(new)
                self._waits.notify()

    def replicate_all(self) -> None:
        """Hand every set remembered to ``on_made`` again: a backup that joined after they were made."""
        with self._cv:
            if self._made:
                self._on_made(dict(self._made))

    def roster_changed(self) -> None:
        """A trainer closed, was dropped or came back: a step may be made without those that left, or its set
        forgotten if none of it is left."""
        with self._cv:
            self._forget_abandoned()
            self._make_full()
            self._waits.notify()

    def parked_trainers(self) -> Set[int]:
        """The trainers whose claim waits now (alive while they wait)."""
        with self._cv:
            return self._waits.parked_trainers()

    def stop(self) -> None:
        """Refuse every waiting and later claim with ShuttingDown."""
        with self._cv:
            self._waits.stop()
