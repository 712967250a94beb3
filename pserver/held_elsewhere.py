"""HeldElsewhere: the parts of a pserver holding trainers' calls outside the engine, as the engine sees them.

The Reduce service and the Claim service park trainers' calls under locks of their own, and the RPC layer
counts the calls it is serving (:class:`~pserver.rpc.arrival.CallsInProgress`). The engine asks them whom
they hold (a held trainer is alive: ``held_elsewhere``) and tells them when its roster changes, so a
waiting round looks again at whom it expects (``on_roster_change``); they in turn ask the engine whom
they expect, admit and heard from, and the Claim service takes its roll-backs.

Each needs the other. The cycle is broken here: this notification point is built first and handed to the
engine as those two callbacks; each part, built from the engine, joins it before the pserver serves
(:meth:`HeldElsewhere.join`). Nothing is set on another object after its construction.
"""

from __future__ import annotations

from typing import AbstractSet, Callable, Optional, Set, Tuple


class HeldElsewhere:
    """Whom the parts outside the engine hold (:meth:`trainers`), and their wake-ups (:meth:`roster_changed`).

    Joined in the order the parts are built; told and asked in that order. Lock order as the engine's
    callbacks require: called after the engine released its lock, never under it.
    """

    def __init__(self):
        self._held: Tuple[Callable[[], AbstractSet[int]], ...] = ()
        self._wakes: Tuple[Callable[[], None], ...] = ()

    def join(
        self, held: Callable[[], AbstractSet[int]], roster_changed: Optional[Callable[[], None]] = None
    ) -> None:
        """A part that holds calls: ``held()`` gives whom it holds now; ``roster_changed()`` (if any) wakes
        its waits to look again."""
        self._held += (held,)  # a new tuple: a reader on another thread sees the old one or the new one
        if roster_changed is not None:
            self._wakes += (roster_changed,)

    def trainers(self) -> Set[int]:
        """The trainers some part holds a call of now: the engine's ``held_elsewhere``."""
        found: Set[int] = set()
        for held in self._held:
            found |= held()
        return found

    def roster_changed(self) -> None:
        """The engine's live trainers may have changed (or it rolled back): its ``on_roster_change``."""
        for wake in self._wakes:
            wake()
