"""StartedPush: a push-pull sent to one pserver over the data channel, its answer read later.

:meth:`trainer.steppers.transfers.Transfers.push_all` sends every pserver its push, then reads the answers,
on the step's own thread (:mod:`.data.started`). Reading an answer fails as :meth:`.tensor_calls.TensorCalls.
push_pull` fails, with one exception kept from it: a connection found broken (DOWN) is the case where that
call tries again on a new connection (and, with hot standby, follows the shard's primary), so here the push
is made again by that very call. A push made twice is counted once (the pserver acknowledges a retry of a
step it counted without counting it again).
"""

from __future__ import annotations

from typing import Callable

from ..errors import DOWN, PserverError
from .contact import Contact
from .data.started import StartedPushPull
from .status_codes import call_errors


class StartedPush:
    """The push-pull ``started`` to ``endpoint``: in flight for ``contact`` until it ends; ``what`` names it
    in errors; ``again()`` makes the whole call anew (the pserver's step); ``count(sent, received)`` adds its
    tensor bytes to the channel's."""

    def __init__(
        self,
        endpoint: str,
        started: StartedPushPull,
        contact: Contact,
        timeout: float,
        what: str,
        again: Callable[[], int],
        count: Callable[[int, int], None],
    ):
        self.endpoint = endpoint
        self._started = started
        self._contact = contact
        self._timeout = timeout
        self._what = what
        self._again = again
        self._count = count

    def finish(self) -> int:
        """The answer read and landed: the pserver's step it reflects."""
        answered = False
        try:
            with call_errors(self.endpoint, self._what):
                pserver_step, _, sent, received = self._started.finish(self._timeout)
            answered = True
        except PserverError as e:
            if e.kind != DOWN:
                raise
        finally:
            self._contact.end(answered)
        if not answered:
            return self._again()
        self._count(sent, received)
        return pserver_step

    def abandon(self) -> None:
        """End it unread (another pserver's push failed first): its connection is closed."""
        self._started.abandon()
        self._contact.end(False)
