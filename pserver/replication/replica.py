"""Replica: one process of a replicated pserver shard, leading it or following its leader.

A thread asks etcd what to do (:func:`.roles.next_step`) every ``POLL`` seconds:
campaign for the lead, copy the primary's state and follow it, or wait. While
it leads it checks its lease just as often; a primary whose lease lapsed (etcd
unreachable, or this process stalled) is *fenced*: it answers nothing more and
ends, and a restart brings it back as the backup. The gRPC side (sending
messages, fetching snapshots) is the injected ``link``
(:class:`pserver.rpc.replica_link.ReplicaLink`); the servicer asks
:meth:`check_serving` before every trainer call and :meth:`wait_acked` before
every answer that reports an applied update. What the engine tells the
backup goes through the engine's :class:`~pserver.engine.listeners.Replication`
listener, which a new primary hands its outbox; it turns the process's
:class:`~pserver.engine.listeners.FileWrites` on (a backup writes no
checkpoint and no export).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from typing import Callable, Iterator, Optional

from psproto import ps_pb2

from ..engine.listeners import FileWrites, Replication
from ..errors import NotPrimary, OutOfSync
from . import snapshot
from .coordination import CoordinationError, Coordinator
from .digest import state_digest
from .follower import Follower
from .outbox import NotFollowed, Outbox
from .roles import BACKUP, CAMPAIGN, FENCED, JOIN, JOINING, PRIMARY, RECOVER, REJOIN, STAY, WAIT, next_step

log = logging.getLogger(__name__)

# How often a primary checks its lease (seconds).
POLL = 0.05
# How often a replica that is not leading reads etcd without being told of a change by its watch.
REREAD = 0.5
# How often a backup asks its primary whether it still is its backup (seconds).
CHECK_EVERY = 0.5
# How long a primary that stops waits for its backup to take the last changes (seconds).
DRAIN = 5.0
# The job is over (every trainer closed): a replica that finds no primary leads nothing.
DONE = "done"


class Replica:
    """This process's place in its shard's replica set, and the threads that keep it.

    ``replication`` is the engine's listener that hands each change to the
    outbox while this process leads; ``files`` the switch of checkpoint and
    export writes, turned on when it starts to lead. ``on_lineage(incarnation)``
    tells the servicer the incarnation trainers see (the state's lineage: one
    value for both replicas, a new one when the shard restarts from a
    checkpoint); ``on_fenced()`` ends the process.
    """

    def __init__(
        self,
        engine,
        program,
        coordinator: Coordinator,
        link,
        replication: Replication,
        files: FileWrites,
        on_lineage: Callable[[int], None],
        on_fenced: Callable[[], None],
        claims=None,
    ):
        cfg = program.config
        self.engine = engine
        self.claims = claims  # backup trainers' StepClaims on the first pserver (its sets replicate too)
        self.replication = replication
        self.files = files
        self.program = program
        self.endpoint = program.endpoint
        self.shard = program.shard
        self.coordinator = coordinator
        self.link = link
        self.on_lineage = on_lineage
        self.on_fenced = on_fenced
        self.takeover_timeout = cfg.replica_takeover_timeout
        self.digest_every = cfg.replica_digest_every
        self.timeout = cfg.rpc_timeout
        self.chunk_bytes = cfg.chunk_bytes
        self.role = JOINING
        self.epoch = 0
        self.leader = ""
        self.lineage = secrets.randbits(63) or 1
        self.outbox: Optional[Outbox] = None
        self.follower: Optional[Follower] = None
        self.was_in_sync = False
        self._next_check = 0.0
        self._stop = threading.Event()
        self._fenced_once = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True, name="replica")

    # -- what the servicer asks -------------------------------------------------

    def check_serving(self) -> None:
        """Refuse (NotPrimary) unless this process leads its shard and its lease is certainly valid."""
        if self.role != PRIMARY or not self.coordinator.holds(self.epoch):
            where = f"; the primary is {self.leader}" if self.leader and self.leader != self.endpoint else ""
            raise NotPrimary(
                f"pserver {self.endpoint} does not lead shard {self.shard} ({self.role}{where}); "
                f"ask the shard's processes who leads"
            )

    def wait_acked(self) -> None:
        """Block until the backup holds every change made so far (nothing to wait for without one)."""
        outbox = self.outbox
        if outbox is not None:
            outbox.wait_acked()

    def digest(self) -> str:
        return state_digest(self.engine.store, self.engine.tables, self.engine.roster.to_meta())

    def lead_reply(self) -> ps_pb2.LeadReply:
        return ps_pb2.LeadReply(
            role=self.role,
            epoch=self.epoch,
            primary=self.leader,
            shard=self.shard,
            step=self.engine.step,
        )

    def stats(self) -> ps_pb2.ReplicaStats:
        """This process's replication state for ps-stat and /metrics."""
        stats = ps_pb2.ReplicaStats(role=self.role, epoch=self.epoch, primary=self.leader)
        outbox, follower = self.outbox, self.follower
        if self.role == PRIMARY and outbox is not None:
            backup, lag = outbox.state()
            if backup is not None:
                stats.backup, stats.backup_in_sync, stats.lag = backup.endpoint, backup.in_sync, lag
            stats.replicated = outbox.sent
        elif follower is not None:
            stats.backup, stats.backup_in_sync = self.endpoint, self.was_in_sync
            stats.replicated, stats.digest_mismatches = follower.applied, follower.mismatches
        return stats

    # -- the primary's answers to a joining backup --------------------------------

    def serve_snapshot(self, request) -> Iterator[ps_pb2.SnapshotChunk]:
        """Copy this primary's state for the process ``request`` names; it becomes the (catching-up)
        backup."""
        self.check_serving()
        outbox = self.outbox
        if request.epoch != self.epoch or outbox is None:
            raise NotPrimary(
                f"pserver {self.endpoint} leads shard {self.shard} at epoch {self.epoch}, not {request.epoch}"
            )
        directory = snapshot.scratch(self.program)
        try:
            started = time.monotonic()
            with self.engine.cv:
                archive = snapshot.write(self.engine, self.program, directory)
                seq = outbox.attach(request.replica_id, request.endpoint)
                pserver_step = self.engine.step
            if self.claims is not None:  # the sets made before it joined, queued for it since attach
                self.claims.replicate_all()
            log.info(
                "primary %s: snapshot at update %d (message %d) for %s, written in %.2fs",
                self.endpoint,
                pserver_step,
                seq,
                request.endpoint,
                time.monotonic() - started,
            )
            first = ps_pb2.SnapshotChunk(
                seq=seq,
                step=pserver_step,
                lineage=str(self.lineage),
                checkpoint_step=self.engine.restored_from,
            )
            yield first
            for data in snapshot.chunks(archive):
                yield ps_pb2.SnapshotChunk(data=data)
        finally:
            snapshot.remove(directory)

    def follow(self, request) -> None:
        """The joining backup loaded the snapshot: send it the changes since."""
        self.check_serving()
        if self.outbox is None or request.epoch != self.epoch:
            raise NotPrimary(f"pserver {self.endpoint} leads at epoch {self.epoch}, not {request.epoch}")
        self.outbox.follow(request.replica_id)

    def receive(self, header, tensors) -> int:
        """A message from the primary (this process follows it): applied; the seq held."""
        follower = self.follower
        if follower is None or self.role != BACKUP:
            raise OutOfSync(f"pserver {self.endpoint} does not follow a primary ({self.role})")
        return follower.receive(header, tensors)

    # -- the thread ---------------------------------------------------------------

    def start(self) -> "Replica":
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop deciding; a primary steps down at once (its lease revoked), so its backup need not wait."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if self.role == PRIMARY:
            if self.outbox is not None:
                self.outbox.drain(DRAIN)
            self.coordinator.resign()
        if self.outbox is not None:
            self.outbox.stop()
        self.coordinator.close()

    def _run(self) -> None:
        no_leader_since = time.monotonic()
        changed = threading.Event()
        self.coordinator.watch(changed.set)
        lost_etcd = False
        while not self._stop.is_set():
            changed.clear()
            try:
                leader, in_sync = self.coordinator.leader(), self.coordinator.in_sync()
            except CoordinationError as e:
                log.warning("replica %s: %s", self.endpoint, e)
                lost_etcd = True
                self._stop.wait(0.5)
                continue
            if lost_etcd:  # etcd answers again: its watch broke with the connection
                lost_etcd = False
                self.coordinator.watch(changed.set)
            if leader is not None:
                no_leader_since = time.monotonic()
            if (
                self.role == BACKUP
                and in_sync is not None
                and self.coordinator.replica_id in in_sync.replicas
            ):
                self.was_in_sync = True
            step = next_step(
                self.role,
                leader,
                in_sync,
                self.coordinator.replica_id,
                self.epoch if self.role == BACKUP else 0,
                self.was_in_sync,
                time.monotonic() - no_leader_since,
                self.takeover_timeout,
            )
            if step == STAY and self.role == BACKUP and not self._still_followed():
                step = REJOIN
            if step in (CAMPAIGN, RECOVER) and self.engine.all_closed.is_set():
                step = (
                    DONE  # every trainer closed: nothing left to lead (the primary wrote the last checkpoint)
                )
            try:
                if step in (CAMPAIGN, RECOVER):
                    if self._campaign(step == RECOVER):
                        self._hold()
                        return
                elif step in (JOIN, REJOIN):
                    self._join(leader)
            except CoordinationError as e:
                log.warning("replica %s: %s", self.endpoint, e)
            except Exception:  # noqa: BLE001 - a failed join is tried again
                log.exception("replica %s: %s failed; trying again", self.endpoint, step)
                self.role = JOINING
                self._stop.wait(0.5)
            if step in (STAY, WAIT, DONE):
                changed.wait(REREAD)  # etcd's watch wakes it at once when the primary or the list changes
            else:
                self._stop.wait(POLL)

    def _still_followed(self) -> bool:
        """Whether the primary still counts this process as its backup (asked every ``CHECK_EVERY`` s).

        A primary drops a backup it cannot reach; a backup that never saw
        itself in etcd's in-sync list would not notice from etcd alone.
        """
        now = time.monotonic()
        if now < self._next_check:
            return True
        self._next_check = now + CHECK_EVERY
        try:
            self.link.follow(
                self.leader,
                ps_pb2.FollowRequest(replica_id=self.coordinator.replica_id, epoch=self.epoch),
                min(self.timeout, 2.0),
            )
        except NotFollowed as e:
            log.info(
                "replica %s: its primary %s no longer counts it as the backup (%s); copying the state again",
                self.endpoint,
                self.leader,
                e,
            )
            return False
        except ConnectionError:
            pass  # the primary is unreachable: etcd says when another leads
        return True

    def _campaign(self, recover: bool) -> bool:
        if recover:
            # Nobody holding every acknowledged update came back: this process leads from what it has
            # (its checkpoint), as a shard without replicas would, under a new lineage.
            self.lineage = secrets.randbits(63) or 1
            log.warning(
                "replica %s: no in-sync replica of shard %d led within %gs; leading from its own "
                "state (update %d); trainers roll back to it",
                self.endpoint,
                self.shard,
                self.takeover_timeout,
                self.engine.step,
            )
        epoch = self.coordinator.campaign(self.endpoint, str(self.lineage), force=recover)
        if epoch is None:
            return False
        follower = self.follower
        if follower is not None:
            follower.stop()
        self.outbox = Outbox(
            (self.coordinator.replica_id, self.endpoint),
            epoch,
            self.link,
            lambda replicas: self.coordinator.set_in_sync(epoch, replicas),
            self.chunk_bytes,
            self.timeout,
            digest=self.digest,
            digest_every=self.digest_every,
            on_fenced=self._fence,
        )
        with self.engine.cv:
            self.replication.lead(self.outbox)
            self.files.take_over()
            self.epoch, self.leader, self.role = epoch, self.endpoint, PRIMARY
        self.engine.take_lead()
        self.on_lineage(self.lineage)
        log.warning(
            "replica %s leads shard %d at epoch %d (update %d)",
            self.endpoint,
            self.shard,
            epoch,
            self.engine.step,
        )
        return True

    def _hold(self) -> None:
        """Lead until the lease lapses (then fenced) or the process stops."""
        while not self._stop.wait(POLL):
            if not self.coordinator.holds(self.epoch) or (self.outbox is not None and self.outbox.fenced):
                self._fence()
                return

    def _fence(self) -> None:
        if not self._fenced_once.acquire(blocking=False):
            return
        self.role = FENCED
        if self.outbox is not None:
            self.outbox.fence()
        log.error(
            "replica %s: lost the lead of shard %d (epoch %d): fenced; it answers nothing more and "
            "stops (restarted, it rejoins as the backup)",
            self.endpoint,
            self.shard,
            self.epoch,
        )
        self.on_fenced()

    def _join(self, leader) -> None:
        """Copy ``leader``'s state, then follow it."""
        follower = self.follower
        if follower is not None:
            follower.stop()
        self.role, self.follower, self.was_in_sync = JOINING, None, False
        self.leader = leader.endpoint
        directory = snapshot.scratch(self.program)
        try:
            started = time.monotonic()
            answer = self.link.fetch_snapshot(
                leader.endpoint,
                ps_pb2.SnapshotRequest(
                    replica_id=self.coordinator.replica_id, endpoint=self.endpoint, epoch=leader.epoch
                ),
                self.timeout,
            )
            first = next(answer)
            snapshot.unpack((chunk.data for chunk in answer), directory)
            with self.engine.cv:
                # The primary's history, not this process's own start: what Hello reports once it leads.
                self.engine.follow_copy(
                    snapshot.load(self.engine, self.program, directory), first.checkpoint_step
                )
                self.follower = Follower(
                    self.engine,
                    leader.epoch,
                    first.seq,
                    self.digest,
                    self.claims.learn_all if self.claims is not None else None,
                )
            self.lineage = int(first.lineage)
            self.epoch, self.role = leader.epoch, BACKUP
            self.link.follow(
                leader.endpoint,
                ps_pb2.FollowRequest(replica_id=self.coordinator.replica_id, epoch=leader.epoch),
                self.timeout,
            )
            log.info(
                "replica %s follows %s (epoch %d) from update %d, copied in %.2fs",
                self.endpoint,
                leader.endpoint,
                leader.epoch,
                first.step,
                time.monotonic() - started,
            )
        finally:
            snapshot.remove(directory)
