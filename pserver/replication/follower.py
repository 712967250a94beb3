"""The backup's side of the replication stream: hold the primary's messages in order, apply them, check digests.

A message is acknowledged once it is held here, in order, in this process's
memory; a thread applies the held messages one after the other. So the backup's
update (as costly as the primary's) is off the path of every trainer's step,
and an acknowledged update still survives the loss of the primary: a backup
that takes the lead applies everything it holds first (:meth:`Follower.drain`).
"""
from __future__ import annotations

import collections
import json
import logging
import threading
from typing import Callable, Dict

import torch

from ..errors import OutOfSync

log = logging.getLogger(__name__)


class Follower:
    """Holds and applies the messages of the primary at ``epoch`` after the snapshot at ``seq``.

    A message of another epoch, or one that skips a seq, is refused
    (:class:`OutOfSync`): the primary then drops this backup, which copies the
    state again. A message already held (a resend) is acknowledged as is.
    ``digest()`` gives this process's state digest, compared with the
    primary's when a message carries one.
    """

    def __init__(self, engine, epoch: int, seq: int, digest: Callable[[], str]):
        self.engine = engine
        self.epoch = epoch
        self.seq = seq            # the last message held
        self.digest = digest
        self.applied = 0
        self.mismatches = 0
        self.matches = 0
        self._held: collections.deque = collections.deque()
        self._applying = False
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._apply_loop, daemon=True, name="replica-follower")
        self._thread.start()

    def receive(self, header, tensors: Dict[str, torch.Tensor]) -> int:
        """Hold one message (its header and tensors) for applying; returns the last seq this backup holds."""
        with self._cv:
            if self._stopped:
                raise OutOfSync(f"this process no longer follows the primary at epoch {self.epoch}")
            if header.epoch != self.epoch:
                raise OutOfSync(f"a message of epoch {header.epoch}; this backup follows epoch {self.epoch}")
            if header.seq <= self.seq:
                return self.seq
            if header.seq != self.seq + 1:
                raise OutOfSync(f"message {header.seq} after {self.seq}: a gap")
            self._held.append((header, tensors))
            self.seq = header.seq
            self._cv.notify_all()
            return self.seq

    def _apply_loop(self) -> None:
        while True:
            with self._cv:
                while not self._held and not self._stopped:
                    self._cv.wait()
                if not self._held:
                    return
                header, tensors = self._held.popleft()
                self._applying = True
            try:
                self._apply(header, tensors)
            except Exception:  # noqa: BLE001 - a bug: logged, and the digests will tell
                log.exception("backup %s: applying message %d failed", self.engine.endpoint, header.seq)
            finally:
                with self._cv:
                    self._applying = False
                    self._cv.notify_all()

    def _apply(self, header, tensors: Dict[str, torch.Tensor]) -> None:
        dense, sparse = self.engine.split_replicated(tensors)
        self.engine.apply_replicated(header.lr_step, header.updates, json.loads(header.roster or "{}"), dense, sparse)
        self.applied += 1
        if not header.digest:
            return
        with self.engine.cv:
            mine = self.digest()
        if mine != header.digest:
            self.mismatches += 1
            log.error("backup %s: state digest after update %d differs from the primary's (%s here, %s there): "
                      "the replicas diverged", self.engine.endpoint, header.updates, mine, header.digest)
        else:
            self.matches += 1
            # The first match says digests are being compared at all; later ones only at debug level.
            log.log(logging.INFO if self.matches == 1 else logging.DEBUG,
                    "backup %s: state digest after update %d matches the primary's", self.engine.endpoint,
                    header.updates)

    def stop(self) -> None:
        """Refuse every later message (this process leads now, or copies a new primary's state)."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()

    def drain(self) -> None:
        """Stop, then apply every message held (before this process leads: each was acknowledged)."""
        self.stop()
        self._thread.join()

    def discard(self) -> None:
        """Stop and drop the messages not applied yet (the state is about to be replaced by a snapshot)."""
        with self._cv:
            self._stopped = True
            self._held.clear()
            self._cv.notify_all()
        self._thread.join()
