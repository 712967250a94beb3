"""Following each pserver shard's primary (hot standby, docs/recovery.md, "Hot standby").

With ``server_replicas=2`` each pserver of the plan is served by two processes;
one leads at a time. A call that finds its shard's process gone (the kind
DOWN: unreachable, shutting down, or a replica that does not lead) asks every
process of the shard who leads (the Lead call), goes to the one that leads at
the highest epoch, says Hello there (a new session), and sends the same call
again. Resending is safe: a push of a (trainer, step) the new primary already
holds is acknowledged and not applied twice, and what the old primary
acknowledged the new one holds. Without replicas every call goes through as is.

:func:`choose_primary` is the decision (pure, table-tested); :class:`ShardPrimary`
wraps it with the calls it is given (:class:`ShardCalls`: the trainer's
:class:`~trainer.transport.shard_link.ShardLink` to the shard).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Mapping, Optional, Protocol, Sequence, Tuple, TypeVar

from psproto import ps_pb2

from ..errors import DOWN, PserverError, PserverUnavailableError

log = logging.getLogger(__name__)

T = TypeVar("T")

# Seconds between two rounds of Lead calls while a shard has no primary yet.
POLL = 0.05


MOVED_ON = "moved on"  # a Lead answer's role from a process of a later layout than the trainer's


def choose_primary(answers: Mapping[str, Optional[Tuple[str, int]]], known_epoch: int) -> Optional[str]:
    """The process to follow: of those answering ("primary", epoch) at an epoch >= ``known_epoch``, the
    highest; first, one of a later layout (:data:`MOVED_ON`), whose Hello tells the trainer where its job
    went even while that layout's shard has no primary yet.

    ``answers`` maps each process of the shard to its Lead answer (role, epoch), or None when it did not
    answer. None: nobody leads yet (a backup waits for the lease of a dead primary to lapse), ask again.
    """
    moved_on = sorted(a for a, answer in answers.items() if answer is not None and answer[0] == MOVED_ON)
    if moved_on:
        return moved_on[0]
    leading = [
        (epoch, address)
        for address, answer in answers.items()
        if answer is not None
        for role, epoch in (answer,)
        if role == "primary" and epoch >= known_epoch
    ]
    return max(leading)[1] if leading else None


class ShardCalls(Protocol):
    """The calls a shard's primary is followed with, to the processes of pserver ``endpoint``'s shard."""

    endpoint: str

    def connect(self, address: str) -> None:
        """Point the pserver's calls at the process at ``address``."""

    def lead(self, address: str, timeout: float) -> Optional[Tuple[str, int]]:
        """Whether the process at ``address`` leads: (role, epoch), or None if it did not answer."""

    def hello_here(self, deadline: float, join_at: int = 0) -> ps_pb2.HelloReply:
        """Open a session at the process the calls go to, waiting for it until ``deadline``."""


class ShardPrimary:
    """Which process of one pserver's shard its calls go to, and following the primary when it moves.

    ``addresses``: the shard's processes (one without hot standby); ``shard``
    does the calls (:class:`ShardCalls`).
    """

    def __init__(self, shard: ShardCalls, addresses: Sequence[str], trainer_id: int, timeout: float):
        self._shard = shard
        self.addresses = list(addresses)
        self.trainer_id = trainer_id
        self.timeout = timeout
        self.address = self.addresses[0]
        self.epoch = 0
        # Moves on each follow: a call that failed before it need not follow again.
        self.generation = 0
        self.failovers = 0
        self._lock = threading.Lock()

    @property
    def replicated(self) -> bool:
        """Whether the shard has a backup to follow (hot standby)."""
        return len(self.addresses) > 1

    def run(self, attempt: Callable[[], T]) -> T:
        """``attempt()`` (one call to the current process); on DOWN, follow the primary and call again.

        Gives up after ``timeout`` seconds without a primary, raising the last error.
        """
        if not self.replicated:
            return attempt()
        deadline = None
        while True:
            generation = self.generation
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
                log.info(
                    "trainer %d: %s: %s; asking its processes who leads",
                    self.trainer_id,
                    self._shard.endpoint,
                    e,
                )
                self.follow(generation, deadline)

    def follow(self, generation: int, deadline: float, join_at: int = 0) -> Optional[ps_pb2.HelloReply]:
        """Find the primary and open a session there: its Hello answer; None if another call did since
        ``generation``.

        ``join_at``: what a (re)joining trainer's Hello says (see ``Channels.hello``).
        """
        pserver = self._shard.endpoint
        with self._lock:
            if self.generation != generation:
                return None
            started = time.monotonic()
            while True:
                answers = {
                    address: self._shard.lead(address, min(1.0, max(0.05, deadline - time.monotonic())))
                    for address in self.addresses
                }
                address = choose_primary(answers, self.epoch)
                if address is not None:
                    try:
                        if address != self.address:
                            self._shard.connect(address)
                            self.address = address
                        reply = self._shard.hello_here(min(deadline, time.monotonic() + 5.0), join_at)
                    except PserverError as e:
                        if e.kind != DOWN:
                            raise
                        log.info("trainer %d: %s at %s: %s", self.trainer_id, pserver, address, e)
                    else:
                        before, epoch = self.epoch, reply.replica_epoch
                        self.epoch = max(before, epoch)
                        self.generation += 1
                        if before and epoch != before:
                            self.failovers += 1
                            log.warning(
                                "trainer %d: %s is served by %s now (epoch %d), found in %.2fs",
                                self.trainer_id,
                                pserver,
                                address,
                                epoch,
                                time.monotonic() - started,
                            )
                        elif not before:
                            log.info(
                                "trainer %d: %s is served by %s (epoch %d)",
                                self.trainer_id,
                                pserver,
                                address,
                                epoch,
                            )
                        return reply
                if time.monotonic() >= deadline:
                    raise PserverUnavailableError(
                        pserver,
                        f"no process of {self.addresses} leads after {self.timeout:g}s (answers: {answers})",
                    )
                time.sleep(POLL)
