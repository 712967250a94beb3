"""Following each pserver shard's primary (hot standby, README "Hot standby").

With ``server_replicas=2`` each pserver of the plan is served by two processes;
one leads at a time. A call that finds its shard's process gone (the kind
DOWN: unreachable, shutting down, or a replica that does not lead) asks every
process of the shard who leads (the Lead call), goes to the one that leads at
the highest epoch, says Hello there (a new session), and sends the same call
again. Resending is safe: a push of a (trainer, step) the new primary already
holds is acknowledged and not applied twice, and what the old primary
acknowledged the new one holds. Without replicas every call goes through as is.

:func:`choose_primary` is the decision (pure, table-tested); :class:`Primaries`
wraps it with the communicator's calls, which it is given.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, List, Mapping, Optional, Tuple, TypeVar

from .errors import DOWN, PserverError, PserverUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between two rounds of Lead calls while a shard has no primary yet.
POLL = 0.05


def choose_primary(answers: Mapping[str, Optional[Tuple[str, int]]], known_epoch: int) -> Optional[str]:
    """The process to follow: of those answering ("primary", epoch) at an epoch >= ``known_epoch``, the highest.

    ``answers`` maps each process of the shard to its Lead answer (role, epoch),
    or None when it did not answer. None: nobody leads yet (a backup waits for
    the lease of a dead primary to lapse), ask again.
    """
    leading = [(epoch, address) for address, answer in answers.items()
               if answer is not None for role, epoch in (answer,) if role == "primary" and epoch >= known_epoch]
    return max(leading)[1] if leading else None


class Primaries:
    """Where each shard's primary is, and the calls that follow it when it moves.

    ``groups``: each pserver of the plan and its processes. ``connect(pserver,
    address)`` points the communicator's channel for ``pserver`` at
    ``address``; ``lead(address, timeout)`` asks one process (role, epoch) or
    None; ``hello(pserver, deadline)`` opens a session there and returns the
    epoch it answered at.
    """

    def __init__(self, groups: Mapping[str, List[str]], connect: Callable[[str, str], None],
                 lead: Callable[[str, float], Optional[Tuple[str, int]]],
                 hello: Callable[[str, float, int], int], trainer_id: int, timeout: float):
        self.groups = {ep: list(group) for ep, group in groups.items()}
        self.connect = connect
        self.lead = lead
        self.hello = hello
        self.trainer_id = trainer_id
        self.timeout = timeout
        self.address = {ep: group[0] for ep, group in self.groups.items()}
        self.epoch = {ep: 0 for ep in self.groups}
        self.generation = {ep: 0 for ep in self.groups}
        self.failovers = 0
        self._locks = {ep: threading.Lock() for ep in self.groups}

    def replicated(self, pserver: str) -> bool:
        return len(self.groups.get(pserver, ())) > 1

    def run(self, pserver: str, attempt: Callable[[], T]) -> T:
        """``attempt()`` (one call to ``pserver``'s current process); on DOWN, follow the primary and call again.

        Gives up after ``timeout`` seconds without a primary, raising the last error.
        """
        if not self.replicated(pserver):
            return attempt()
        deadline = None
        while True:
            generation = self.generation[pserver]
            try:
                return attempt()
            except PserverError as e:
                if e.kind != DOWN:
                    raise
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout
                if now >= deadline:
                    raise
                log.info("trainer %d: %s: %s; asking its processes who leads", self.trainer_id, pserver, e)
                self.follow(pserver, generation, deadline)

    def follow(self, pserver: str, generation: int, deadline: float, join_at: int = 0) -> None:
        """Find ``pserver``'s primary and open a session there, unless another call already did since ``generation``.

        ``join_at``: what a (re)joining trainer's Hello says (see Communicator.hello).
        """
        with self._locks[pserver]:
            if self.generation[pserver] != generation:
                return
            started = time.monotonic()
            while True:
                answers = {address: self.lead(address, min(1.0, max(0.05, deadline - time.monotonic())))
                           for address in self.groups[pserver]}
                address = choose_primary(answers, self.epoch[pserver])
                if address is not None:
                    try:
                        if address != self.address[pserver]:
                            self.connect(pserver, address)
                            self.address[pserver] = address
                        epoch = self.hello(pserver, min(deadline, time.monotonic() + 5.0), join_at)
                    except PserverError as e:
                        if e.kind != DOWN:
                            raise
                        log.info("trainer %d: %s at %s: %s", self.trainer_id, pserver, address, e)
                    else:
                        before = self.epoch[pserver]
                        self.epoch[pserver] = max(before, epoch)
                        self.generation[pserver] += 1
                        if before and epoch != before:
                            self.failovers += 1
                            log.warning("trainer %d: %s is served by %s now (epoch %d), found in %.2fs",
                                        self.trainer_id, pserver, address, epoch, time.monotonic() - started)
                        elif not before:
                            log.info("trainer %d: %s is served by %s (epoch %d)", self.trainer_id, pserver,
                                     address, epoch)
                        return
                if time.monotonic() >= deadline:
                    raise PserverUnavailableError(pserver, f"no process of {self.groups[pserver]} leads after "
                                                           f"{self.timeout:g}s (answers: {answers})")
                time.sleep(POLL)
