"""The backup's side of the replication stream: apply the primary's messages in order, check its digest."""

from __future__ import annotations

import json
import logging
import threading
from typing import AbstractSet, Callable, Dict, Mapping, Optional, Tuple

import torch

from ..engine.listeners import STEP_SETS
from ..errors import OutOfSync
from ..tables import SparseGrad

log = logging.getLogger(__name__)


def split_update(
    tensors: Mapping[str, torch.Tensor], blocks: AbstractSet[str]
) -> Tuple[Dict[str, torch.Tensor], Dict[str, SparseGrad]]:
    """(dense gradients, {table: (ids, rows)}) of an update the primary applied, from a message's tensors.

    The primary merged and checked it: its ids are unique and of this shard,
    so they are taken as they are (no hashing, no merging on the backup).
    """
    dense = {name: t for name, t in tensors.items() if name in blocks}
    sparse = {
        name[: -len("@ids")]: (t.numpy(), tensors[name[: -len("@ids")] + "@rows"])
        for name, t in tensors.items()
        if name.endswith("@ids")
    }
    return dense, sparse


class Follower:
    """Applies the messages of the primary at ``epoch`` after the snapshot at ``seq``.

    A message of another epoch, or one that skips a seq, is refused
    (:class:`OutOfSync`): the primary then drops this backup, which copies the
    state again. A message already applied (a resend) is acknowledged as is.
    ``digest()`` gives this process's state digest, compared with the
    primary's when a message carries one. ``learn_step_sets``: where the
    backup trainers' step sets of a claims message go (the first pserver's
    :meth:`~pserver.engine.StepClaims.learn_all`; None elsewhere).
    """

    def __init__(
        self,
        engine,
        epoch: int,
        seq: int,
        digest: Callable[[], str],
        learn_step_sets: Optional[Callable[[Mapping], None]] = None,
    ):
        self.engine = engine
        self.learn_step_sets = learn_step_sets
        self.epoch = epoch
        self.seq = seq
        self.digest = digest
        self.applied = 0
        self.mismatches = 0
        self.matches = 0
        self._lock = threading.Lock()
        self._stopped = False

    def receive(self, header, tensors: Dict[str, torch.Tensor]) -> int:
        """Apply one message (its header and tensors); returns the last seq this backup holds."""
        with self._lock:
            if self._stopped:
                raise OutOfSync(f"this process no longer follows the primary at epoch {self.epoch}")
            if header.epoch != self.epoch:
                raise OutOfSync(f"a message of epoch {header.epoch}; this backup follows epoch {self.epoch}")
            if header.seq <= self.seq:
                return self.seq
            if header.seq != self.seq + 1:
                raise OutOfSync(f"message {header.seq} after {self.seq}: a gap")
            if header.lr_step == STEP_SETS:
                if self.learn_step_sets is not None:
                    self.learn_step_sets(json.loads(header.roster)["step_sets"])
                self.seq = header.seq
                return self.seq
            dense, sparse = split_update(tensors, self.engine.store.names())
            self.engine.apply_replicated(
                header.lr_step, header.step, json.loads(header.roster or "{}"), dense, sparse
            )
            self.seq = header.seq
            self.applied += 1
            if header.digest:
                with self.engine.cv:
                    mine = self.digest()
                if mine != header.digest:
                    self.mismatches += 1
                    log.error(
                        "backup %s: state digest after update %d differs from the primary's (%s here, "
                        "%s there): the replicas diverged",
                        self.engine.endpoint,
                        header.step,
                        mine,
                        header.digest,
                    )
                else:
                    self.matches += 1
                    # The first match says digests are being compared at all; later ones only at debug level.
                    log.log(
                        logging.INFO if self.matches == 1 else logging.DEBUG,
                        "backup %s: state digest after update %d matches the primary's",
                        self.engine.endpoint,
                        header.step,
                    )
            return self.seq

    def stop(self) -> None:
        """Refuse every later message (this process leads now, or copies a new primary's state)."""
        with self._lock:
            self._stopped = True
