"""LayoutSwitch: one pserver's part in a change of its job's pserver count, at a sync step boundary.

A change asked (``ps-reshard``) is carried out by the pservers themselves, through the record
(:mod:`.phases`, kept by compare-and-set in ``checkpoint_dir``):

1. The job's first pserver, on its next update, schedules the switch at the end of the step two ahead.
   Two is enough: in sync mode every trainer's push of a step is answered only once its step is
   applied, so no pserver can apply a step before the first pserver has applied the one before it, and
   the first pserver writes the switch step before it applies its next update. Every other pserver
   reads the record after each update (a ``stat`` while it is unchanged), so each reads it before
   passing the switch step.
2. Each current pserver, having applied the switch step, stops there: pushes of later steps are refused
   (``ShuttingDown`` until the change commits: the trainers retry). It writes its part of the
   checkpoint of that step and reports; the last report commits the change: the record names the next
   epoch, its pservers and the step they start from.
3. After the commit every refused call is answered "moved" with the next layout (:class:`Moved`): the
   trainers adopt it and push the step again there. A pserver of the next layout serves its next
   generation (:meth:`pserver.server.ParameterServer.serve`, on the same ports, in the same process)
   from that checkpoint, re-sharded; a new pserver waiting for the change starts then
   (:mod:`.joining`); one that leaves answers "moved" until every trainer was told, or for
   ``heartbeat_timeout``, then stops.

Async, the same with a switch step per trainer: the first pserver picks, for each trainer, the step two
after the last it counted of it; every pserver reads the record before each push and refuses a trainer's
pushes from its switch step on, so each push is applied by every pserver or by none (a push is answered
once applied, and a trainer pushes its next step only then), and writes its part once each live
trainer's pushes before its switch step are applied. The refused pushes go again, whole, in the next
layout: every acknowledged push is applied exactly once.

Any failure before the commit (a pserver that dies, a checkpoint that cannot be written, the commit not
reached within ``barrier_timeout``) rolls the change back: the stopped pservers go on in the current
layout from the switch step, where they stand (the checkpoint written is an ordinary one). A GEO,
backup-trainer or async-pipeline job's pservers roll an asked change back saying why (docs/operations.md).

Hot standby: a shard's primary takes its part (the record names shards by their pserver endpoint); its
backup applies no update through the listeners and reads the record now and then instead, ending its
generation at the commit as its primary does. Each process of the next layout (pserver or backup) serves
its next generation from the switch step's checkpoint, and each shard's two processes there elect their
primary anew (fresh keys for the layout's epoch), the other joining as its backup. A backup that takes the
lead during the switch (its primary lost) rolls the change back, as a restarted pserver does without
replicas; one that takes it after the commit answers "moved" at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Optional, Set

from transpiler import PserverProgram
from transpiler.layout.change import recorded_layout
from transpiler.layout.change_checks import LayoutChangeRefused, check_fit
from transpiler.layout.record import LayoutRecord, read_record_file

from ..engine.listeners import Gate, UpdateListener
from ..errors import Moved, ShuttingDown
from . import phases
from .stores import FileLayoutStore, update

log = logging.getLogger(__name__)

SWITCH_AHEAD = 2  # steps between the first pserver scheduling a switch and the switch step (see above)
POLL_S = 0.01  # how often a stopped pserver reads the record while it waits for the commit
WATCH_S = 0.1  # how often a hot standby's process reads it for a commit its primary waits for


def available_memory() -> int:
    """Bytes of memory this host can give without swapping (``MemAvailable``; a huge number where unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62


def unsupported(program: PserverProgram) -> Optional[str]:
    """Why ``program``'s job cannot change its pserver count while it runs (None: it can)."""
    cfg = program.config
    if cfg.k_steps:
        return "a GEO job cannot change its pserver count while it trains yet; restart it from a checkpoint"
    if cfg.backup_trainers:
        return "a job with backup trainers cannot change its pserver count while it trains yet"
    if not program.sync_mode and cfg.async_pipeline:
        return "a job with the async pipeline cannot change its pserver count while it trains yet"
    return None


class LayoutSwitch(UpdateListener, Gate):
    """One pserver's part in its job's changes of layout: the engine's listener (told of each update, under
    its lock) and its gate (refusing the steps after a switch).

    ``done`` is set once this generation of the pserver is done: the change it stopped for committed (a
    pserver of the next layout then starts its next generation: :attr:`moved`), or, for a pserver that
    leaves the job, once it has told its trainers; it is also set when the process stops. :meth:`start`
    hands it the engine it stops.
    """

    def __init__(self, program: PserverProgram, done: threading.Event):
        cfg = program.config
        self.store = FileLayoutStore(cfg.checkpoint_dir)
        self.endpoint = program.pservers[program.shard]  # the shard's name in the record (its backup's too)
        self.replicated = program.replicated
        self._done = done
        self.epoch = program.layout_epoch
        self.trainers = program.trainers
        self.commit_timeout = cfg.barrier_timeout
        self.linger_s = cfg.heartbeat_timeout
        self.why_not = unsupported(program)
        self._engine = None
        self._initial = recorded_layout(program)
        self._seen: Optional[tuple] = None  # the record file's (inode, mtime, size) when last read
        self._record: Optional[LayoutRecord] = None
        self.frozen_at: Optional[int] = None  # the switch step this pserver stopped at
        self.moved: Optional[LayoutRecord] = None  # the committed record of that change
        self._told: Set[int] = set()  # trainers answered "moved" (a pserver that leaves waits for all)
        self.sync = program.sync_mode
        self._asking = False  # async: a thread asks whether the pushes before the switch are all applied
        self._fit_checked: Set[int] = set()  # the changes (their epochs) whose fit this pserver checked
        self._awaiting = False  # its part written, this pserver waits for the commit (_await_commit)

    def start(self, engine) -> None:
        """Before serving, with the ``engine`` to stop: write the record if the job has none yet; a change
        this pserver was stopped for when it died (its state is gone: it resumed from a checkpoint) is
        rolled back."""
        self._engine = engine
        # A pserver started in a later layout than the record's (changed by hand) records it.
        record = self._swap(lambda r: r if r.epoch >= self.epoch else self._initial, "record the layout")
        change = record.change if record is not None else None
        if self.replicated:  # a restart is no loss with a backup: one that takes the lead may be (on_lead)
            threading.Thread(target=self._watch_commit, daemon=True, name="pserver-layout-watch").start()
        elif change is not None and change.phase == "switching" and self.endpoint in record.pservers:
            self._roll_back(f"pserver {self.endpoint} restarted during the switch")

    # -- the engine's listener (under its lock) --------------------------------------------------------

    def on_update(self, lr_step, pserver_step, roster, dense, sparse) -> None:
        record = self._fresh()
        if (
            record is None
            or record.change is None
            or record.epoch != self.epoch
            or self.frozen_at is not None
        ):
            return
        change = record.change
        if self.why_not is not None and change.phase in ("asked", "switching"):
            self._roll_back(self.why_not)
        elif (
            change.epoch not in self._fit_checked and self.endpoint in change.pservers and self._short(record)
        ):
            return
        elif change.phase == "asked" and self.endpoint == record.pservers[0]:
            self._schedule(pserver_step, change.epoch)
        elif change.phase == "switching" and self.endpoint in record.pservers:
            if not self.sync:
                self._save_once_pushed(change)
            elif change.switch_step == pserver_step:
                self._stop_and_save(pserver_step, change.epoch)
            elif change.switch_step < pserver_step:  # not seen in time: a bug, never a lost step
                self._roll_back(f"pserver {self.endpoint} passed the switch step {change.switch_step}")

    def _short(self, record: LayoutRecord) -> bool:
        """Whether this pserver, staying in the next layout, lacks the memory for its share of the job's
        state there (then the change is rolled back, saying so): its own state times the count now, spread
        over the next count, against its host's available memory (checked once per change)."""
        self._fit_checked.add(record.change.epoch)
        stats = self._engine.stats()
        own = stats.block_bytes + stats.table_bytes
        try:
            check_fit(
                {ep: own for ep in record.pservers},
                {self.endpoint: available_memory()},
                record.change.pservers,
            )
        except LayoutChangeRefused as e:
            self._roll_back(str(e))
            return True
        return False

    def _schedule(self, pserver_step: int, epoch: int) -> None:
        """The first pserver picks where the switch is: sync, the step two ahead; async, each trainer's step
        two after the last this pserver counted (the same argument, trainer by trainer: a trainer's push is
        answered once applied, and it pushes its next step only then)."""
        if self.sync:
            step, steps = pserver_step + SWITCH_AHEAD, None
            where = f"after step {step}"
        else:
            counted = self._engine.last_step
            step, steps = None, {t: counted.get(t, -1) + SWITCH_AHEAD for t in range(self.trainers)}
            where = f"at the trainers' steps {steps}"
        if self._swap(lambda r: phases.schedule_switch(r, step, steps), "schedule the switch") is not None:
            log.info("pserver %s: layout epoch %d starts %s", self.endpoint, epoch, where)

    def on_roster(self, pserver_step, roster) -> None:
        pass

    def on_reset(self, step: int) -> None:
        pass

    # -- the engine's gate (under its lock) ------------------------------------------------------------

    def check_push(self, trainer_id: int, step: int) -> None:
        if self.sync:
            if self.frozen_at is not None and step >= self.frozen_at:
                self._refuse(trainer_id)
            return
        if self.frozen_at is not None:  # async: this pserver's part is written; nothing more is applied
            self._refuse(trainer_id)
        record = self._fresh()  # async: read before every push (a stat while unchanged)
        if record is not None and record.epoch > self.epoch:  # a backup that led after the commit, unaware
            self.frozen_at, self.moved = self._engine.step, record
            self._refuse(trainer_id)
        change = record.change if record is not None and record.epoch == self.epoch else None
        if change is not None and change.phase == "switching" and self.endpoint in record.pservers:
            if step >= change.switch_steps.get(str(trainer_id), step + 1):
                self._save_once_pushed(change)
                self._refuse(trainer_id)

    def check_wait(self, trainer_id: int, min_step: int) -> None:
        if self.frozen_at is not None and min_step > self.frozen_at:
            self._refuse(trainer_id)

    def check_hello(self, trainer_id: int) -> None:
        if self.moved is not None:
            self._refuse(trainer_id)

    def on_lead(self) -> None:
        record = self.store.read()
        if phases.on_new_primary(record, self.epoch, self.endpoint) == phases.ROLL_BACK:
            self._roll_back(f"the primary of {self.endpoint} was lost during the switch")
            record = self.store.read()  # or the change committed first
        if phases.on_new_primary(record, self.epoch, self.endpoint) == phases.MOVED:
            self.frozen_at, self.moved = self._engine.step, record

    def _refuse(self, trainer_id: int) -> None:
        moved = self.moved
        if moved is None:
            raise ShuttingDown(f"pserver {self.endpoint}: the job's pserver count is changing; retry")
        self._told.add(trainer_id)
        raise Moved(
            f"pserver {self.endpoint}: layout epoch {self.epoch} ended after update {self.frozen_at}",
            moved.epoch,
            moved.pservers,
            moved.replicas,
        )

    # -- the switch --------------------------------------------------------------------------------------

    def _save_once_pushed(self, change) -> None:
        """Async (under the engine's lock): write this pserver's part once every live trainer's pushes before
        its switch step are applied; until then a thread asks again (a trainer that pushes no more, having
        died, is dropped after ``heartbeat_timeout`` and counts no more)."""
        steps = {int(t): k for t, k in change.switch_steps.items()}
        live, counted = self._engine.live(), self._engine.last_step
        if all(counted.get(t, -1) >= k - 1 for t, k in steps.items() if t in live):
            self._stop_and_save(self._engine.step, change.epoch)
        elif not self._asking:
            self._asking = True
            threading.Thread(target=self._ask_until_pushed, daemon=True, name="pserver-layout-pushed").start()

    def _ask_until_pushed(self) -> None:
        deadline = time.monotonic() + self.commit_timeout
        while time.monotonic() < deadline:
            time.sleep(POLL_S)
            with self._engine.cv:
                record = self._fresh()
                change = record.change if record is not None else None
                if self.frozen_at is not None or change is None or change.phase != "switching":
                    break
                self._save_once_pushed(change)
        self._asking = False

    def _stop_and_save(self, step: int, epoch_next: int) -> None:
        self.frozen_at = step
        started = time.monotonic()
        try:
            self._engine.checkpoint()
        except Exception as e:  # noqa: BLE001 - any failure to write the part abandons the change
            log.exception("pserver %s: the checkpoint of the switch step %d failed", self.endpoint, step)
            self._roll_back(f"pserver {self.endpoint} could not write the checkpoint of step {step}: {e}")
            self.frozen_at = None
            return
        self._swap(lambda r: phases.report_saved(r, self.endpoint, time.time()), "report its part")
        log.info(
            "pserver %s: stopped after step %d for layout epoch %d; its part written in %.2fs",
            self.endpoint,
            step,
            epoch_next,
            time.monotonic() - started,
        )
        self._awaiting = True
        threading.Thread(target=self._await_commit, daemon=True, name="pserver-layout-switch").start()

    def _await_commit(self) -> None:
        """Outside the lock: wait for the change to commit (then hand over) or roll back (then go on)."""
        deadline = time.monotonic() + self.commit_timeout
        while True:
            record = self.store.read()
            if record is not None and record.epoch > self.epoch:
                self.moved = record
                log.info(
                    "pserver %s: layout epoch %d committed, %d pservers from step %d",
                    self.endpoint,
                    record.epoch,
                    len(record.pservers),
                    record.since_step,
                )
                if self.endpoint not in record.pservers:
                    self._linger()
                self._done.set()
                return
            change = record.change if record is not None else None
            if change is None or change.phase == "rolling_back":
                if change is not None:
                    self._swap(phases.rolled_back, "finish rolling back")
                log.warning(
                    "pserver %s: the change of layout was rolled back (%s); going on from step %d",
                    self.endpoint,
                    change.why if change is not None else "by another",
                    self.frozen_at,
                )
                self.frozen_at, self._awaiting = None, False
                return
            if time.monotonic() > deadline:
                waiting = sorted(set(record.pservers) - set(change.switched))
                self._roll_back(f"{waiting} did not write their part within {self.commit_timeout:.0f}s")
            time.sleep(POLL_S)

    def _watch_commit(self) -> None:
        """Hot standby: a backup (which applies no update through the listeners) ends its generation at the
        commit as its primary does; a primary that stopped for the change waits in :meth:`_await_commit`."""
        while not self._done.wait(WATCH_S):
            record = self.store.read()
            if record is None or record.epoch <= self.epoch:
                continue
            with self._engine.cv:
                if self._awaiting:
                    return  # this process stopped for the change as its shard's primary: its own wait ends it
                if self.moved is None:
                    self.frozen_at, self.moved = self._engine.step, record
            log.info("pserver %s (backup): layout epoch %d committed", self.endpoint, record.epoch)
            self._done.set()
            return

    def _linger(self) -> None:
        """A pserver that leaves the job answers "moved" until every trainer has been told, or for
        ``heartbeat_timeout`` (a trainer that asks later learns it from the other pservers)."""
        deadline = time.monotonic() + self.linger_s
        while len(self._told) < self.trainers and time.monotonic() < deadline:
            time.sleep(POLL_S)
        log.info("pserver %s: leaves the job (layout epoch %d)", self.endpoint, self.moved.epoch)

    # -- the record --------------------------------------------------------------------------------------

    def status(self) -> phases.LayoutStatus:
        """The job's change of layout in progress, as the record says now (Stats, ps-stat, /metrics)."""
        return phases.status_of(read_record_file(self.store.directory))

    def _fresh(self) -> Optional[LayoutRecord]:
        """The record, read again only if its file changed (a ``stat`` per update otherwise)."""
        try:
            st = os.stat(self.store.path)
        except FileNotFoundError:
            return None
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            self._record, self._seen = self.store.read(), seen
        return self._record

    def _swap(self, transition, what: str) -> Optional[LayoutRecord]:
        """The record after ``transition`` (compare-and-set); None, logged, if its change is gone."""
        try:
            return update(self.store, transition, self._initial)
        except LayoutChangeRefused as e:
            log.info("pserver %s: did not %s: %s", self.endpoint, what, e)
            return None

    def _roll_back(self, why: str) -> None:
        log.warning("pserver %s: rolling the change of layout back: %s", self.endpoint, why)
        self._swap(lambda r: phases.rolled_back(phases.roll_back(r, why)), "roll the change back")
