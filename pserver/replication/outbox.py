"""The primary's side of the replication stream: what it sends its backup, and who waits for the backup's
answer.

Every change the engine makes is handed to :meth:`Outbox.record` under the engine's lock (by its
:class:`~pserver.engine.listeners.Replication` listener), numbered (``seq``) and, while the shard has a
backup, encoded at once (the engine reuses its gradient buffers at the next step). One sender thread sends
the messages in order (:class:`~.backup.Transport`); a trainer's call is answered only after
:meth:`Outbox.wait_acked` saw the backup acknowledge every message recorded before it, so whatever a
trainer was told survives the loss of either process.

The backup's states, what the sender does in each and what a wait needs: :mod:`.backup`. A backup that
fails is taken out of the shard's in-sync list in etcd *before* the waits stop counting on it. Either etcd
write is guarded by the primary's epoch: a primary that lost its lease can do neither, so it can neither
acknowledge alone nor be replaced by a backup that misses an update.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable, Dict, Optional, Tuple

from ..errors import NotPrimary, OutOfSync
from .backup import Backup, ReplicaUnreachable, Transport, encode_update

log = logging.getLogger(__name__)

# Messages kept for a backup still copying the snapshot, at most (bytes): past it that backup is
# dropped and copies the state again, rather than the primary growing without bound.
KEEP_BYTES = 1 << 30


class NotFollowed(ConnectionError):
    """A backup's primary answered that it does not count it as its backup (dropped: :meth:`Outbox.follow`
    refused it); it copies the state again."""


class Outbox:
    """The primary's replication stream: numbering, the backup's queue, acknowledgements and waits.

    ``set_in_sync(replicas)`` writes the shard's in-sync list to etcd under
    this primary's epoch ({replica_id: endpoint}); False means this process no
    longer leads. ``digest()`` gives the state digest (under the engine's lock).
    ``on_fenced`` is called once when an etcd write shows this process lost the lead.
    """

    def __init__(
        self,
        me: Tuple[str, str],
        epoch: int,
        transport: Transport,
        set_in_sync: Callable[[Dict[str, str]], bool],
        chunk_bytes: int,
        timeout: float,
        digest: Optional[Callable[[], str]] = None,
        digest_every: int = 0,
        on_fenced: Optional[Callable[[], None]] = None,
    ):
        self.me = me
        self.epoch = epoch
        self.transport = transport
        self.set_in_sync = set_in_sync
        self.chunk_bytes = chunk_bytes
        self.timeout = timeout
        self.digest = digest
        self.digest_every = digest_every
        self.on_fenced = on_fenced
        self.cv = threading.Condition()
        self.seq = 0  # the last message recorded
        self.acked = 0  # every message up to here is held by the backup, or needs no backup
        self.sent = 0  # messages sent (for ps-stat)
        self.backup: Optional[Backup] = None
        self.fenced = False
        self._stopping = False
        self._thread = threading.Thread(target=self._send_loop, daemon=True, name="replica-sender")
        self._thread.start()

    # -- the engine's side (under its lock) -----------------------------------

    def record(self, lr_step: int, pserver_step: int, roster_meta: dict, dense, sparse) -> int:
        """Number one change and queue it for the backup, if there is one; returns its seq."""
        with self.cv:
            self.seq += 1
            backup = self.backup
            if backup is None or not backup.counted:
                self.acked = self.seq  # nobody to wait for
            if backup is None:
                return self.seq
            digest = ""
            if (
                self.digest is not None
                and self.digest_every
                and lr_step >= 0
                and pserver_step % self.digest_every == 0
            ):
                digest = self.digest()
            messages = encode_update(
                self.epoch,
                self.seq,
                lr_step,
                pserver_step,
                json.dumps(roster_meta),
                digest,
                dense,
                sparse,
                self.chunk_bytes,
            )
            backup.queue_message(self.seq, messages)
            if not backup.following and backup.queued_bytes > KEEP_BYTES:
                log.warning(
                    "primary %s: backup %s copies its snapshot too slowly (%d MiB of updates kept "
                    "since); it copies the state again",
                    self.me[1],
                    backup.endpoint,
                    backup.queued_bytes >> 20,
                )
                self.backup = None
                self.acked = self.seq
            self.cv.notify_all()
            return self.seq

    def attach(self, replica_id: str, endpoint: str) -> int:
        """A process asks for a snapshot to become the backup: the seq the snapshot stands at.

        Called under the engine's lock, with the snapshot taken under the same
        hold. A previous backup is dropped first (out of etcd's in-sync list).
        """
        if not self._drop_backup("a new backup joins"):
            # Its predecessor stays in etcd's in-sync list until etcd answers: no second backup meanwhile.
            raise NotPrimary(f"primary {self.me[1]}: cannot update the in-sync list in etcd now; ask again")
        self.transport.reconnect(endpoint)
        with self.cv:
            self.backup = Backup(replica_id, endpoint)
            log.info(
                "primary %s: %s (%s) joins as the backup from message %d",
                self.me[1],
                endpoint,
                replica_id,
                self.seq,
            )
            return self.seq

    def follow(self, replica_id: str) -> None:
        """The joining backup loaded the snapshot: send it the messages since."""
        with self.cv:
            if self.backup is None or self.backup.replica_id != replica_id:
                raise OutOfSync(
                    f"primary {self.me[1]}: {replica_id} is not its backup (dropped since its "
                    f"snapshot?); it copies the state again"
                )
            if self.backup.following:
                return  # the backup asking again whether it still is one: it is
            # Nearly caught up already (a quiet moment): from now on nothing is acknowledged without it.
            self.backup.follows()
            self.cv.notify_all()

    def reset(self) -> None:
        """The state was rolled back to a checkpoint: the backup's copy no longer follows; it copies again.

        The backup must leave etcd's in-sync list before another update is made: until etcd answers
        this waits, and a primary that cannot reach it within the deadline gives up the lead.
        """
        deadline = time.monotonic() + self.timeout
        while not self._drop_backup("this primary rolled back to a checkpoint"):
            if self.fenced or time.monotonic() > deadline:
                self.fence()
                return

    # -- the servicer's side --------------------------------------------------

    def wait_acked(self, seq: Optional[int] = None) -> None:
        """Block until the backup holds every message up to ``seq`` (default: all recorded so far).

        Without an in-sync backup nothing is waited for. NotPrimary when this
        process was fenced meanwhile, or when the backup neither answers nor is
        dropped within the deadline.
        """
        deadline = time.monotonic() + self.timeout
        with self.cv:
            target = self.seq if seq is None else seq
            while self.acked < target:
                if self.fenced:
                    break
                if self._stopping:
                    raise NotPrimary(f"pserver {self.me[1]} is stopping; ask the shard's processes who leads")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise NotPrimary(
                        f"primary {self.me[1]}: the backup did not acknowledge message {target} "
                        f"within {self.timeout:g}s"
                    )
                self.cv.wait(remaining)
            if self.fenced:
                raise NotPrimary(
                    f"pserver {self.me[1]} lost the lead of its shard (epoch {self.epoch}); "
                    f"ask the shard's processes who leads"
                )

    def drain(self, timeout: float) -> bool:
        """Before this primary stops: wait up to ``timeout`` s until a following backup holds every message.

        So a backup still catching up learns the last changes too (the
        trainers' Close above all), and ends with the job instead of leading
        it after its primary left. True when nothing is left to send.
        """
        deadline = time.monotonic() + timeout
        with self.cv:
            while self.backup is not None and self.backup.following and self.backup.queue and not self.fenced:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self.cv.wait(remaining)
            return self.backup is None or not self.backup.queue

    def state(self) -> Tuple[Optional[Backup], int]:
        """(the backup or None, messages it has not acknowledged yet), for ps-stat and metrics."""
        with self.cv:
            backup = self.backup
            lag = (
                0 if backup is None else (backup.queue[-1][0] - backup.queue[0][0] + 1 if backup.queue else 0)
            )
            return backup, lag

    def fence(self) -> None:
        """This process lost the lead: every wait ends with NotPrimary, nothing more is sent."""
        with self.cv:
            self.fenced = True
            self.backup = None
            self.cv.notify_all()

    def stop(self) -> None:
        with self.cv:
            self._stopping = True
            self.cv.notify_all()
        # A daemon, maybe in a send to an unreachable backup: not waited for long.
        self._thread.join(timeout=1)

    # -- the sender thread ----------------------------------------------------

    def _next(self):
        """What the sender does next: ("send", backup, seq, messages), ("count in", backup) or None (stop)."""
        with self.cv:
            while not self._stopping:
                b = self.backup
                if b is not None and b.following and b.queue:
                    seq, messages = b.queue[0]
                    return "send", b, seq, messages
                if b is not None and b.counted and not b.in_sync and not b.queue:
                    return "count in", b, 0, None
                self.cv.wait(0.5)
            return None

    def _send_loop(self) -> None:
        while True:
            item = self._next()
            if item is None:
                return
            action, backup, seq, messages = item
            if action == "count in":
                self._count_in(backup)
                continue
            try:
                self.transport.send(backup.endpoint, messages, self.timeout)
            except ReplicaUnreachable as e:
                log.warning(
                    "primary %s: backup %s did not take message %d: %s", self.me[1], backup.endpoint, seq, e
                )
                self._drop_backup(str(e), only=backup)
                continue
            with self.cv:
                if self.backup is not backup:
                    continue
                backup.took_first()
                self.sent += 1
                if backup.counted:
                    self.acked = max(self.acked, seq)
                else:
                    # Nearly caught up: from the next message on, nothing is acknowledged without it.
                    backup.count_if_caught_up()
                self.cv.notify_all()

    def _count_in(self, backup: Backup) -> None:
        """The backup holds every message and waits count on it: into etcd's in-sync list."""
        with self.cv:
            if self.backup is not backup or backup.queue or backup.in_sync:
                return
            written = self._write_in_sync({self.me[0]: self.me[1], backup.replica_id: backup.endpoint})
            if written is None:
                self.cv.wait(0.1)
                return
            if not written:
                self._fenced_by_etcd()
                return
            backup.now_in_sync()
            self.cv.notify_all()
            log.info("primary %s: backup %s is in sync at message %d", self.me[1], backup.endpoint, self.seq)

    def _drop_backup(self, why: str, only: Optional[Backup] = None) -> bool:
        """Take the backup out of etcd's in-sync list, then stop waiting for it; fenced if etcd says so.

        False when the backup is still there (etcd did not answer, or this process was fenced).
        """
        with self.cv:
            backup = self.backup
            if backup is None or (only is not None and backup is not only):
                return True
            if backup.in_sync:
                written = self._write_in_sync({self.me[0]: self.me[1]})
                if written is None:  # etcd did not answer: the sender tries again, waits go on waiting
                    self.cv.wait(0.1)
                    return False
                if not written:
                    self._fenced_by_etcd()
                    return False
            self.backup = None
            self.acked = self.seq
            self.cv.notify_all()
        log.warning(
            "primary %s: backup %s dropped (%s); acknowledging alone until a backup catches up",
            self.me[1],
            backup.endpoint,
            why,
        )
        return True

    def _write_in_sync(self, replicas: Dict[str, str]) -> Optional[bool]:
        """etcd's in-sync list := ``replicas``, under this epoch; None when etcd could not be asked."""
        try:
            return self.set_in_sync(replicas)
        except Exception as e:  # noqa: BLE001 - CoordinationError or a transport error: retried
            log.warning(
                "primary %s: cannot write the in-sync replicas %s to etcd: %s",
                self.me[1],
                sorted(replicas.values()),
                e,
            )
            return None

    def _fenced_by_etcd(self) -> None:
        log.error(
            "primary %s: etcd says this process no longer leads its shard (epoch %d); fenced",
            self.me[1],
            self.epoch,
        )
        self.fenced = True
        self.backup = None
        self.cv.notify_all()
        if self.on_fenced is not None:
            threading.Thread(target=self.on_fenced, daemon=True).start()
