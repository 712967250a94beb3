"""A pserver of the emulated fan-in SIGKILLed mid-run and started again with its command: when, and how long
its K trainers take to find it and re-sync.

``bench_fanin --kill_pserver I`` runs the pservers with checkpoints; once pserver I counted half of its
K x steps pushes it is killed, its command started again (it resumes from its last checkpoint), and the
trainers' own recovery (:class:`trainer.recovery.Recovery`, in each emulated trainer) waits for it, says
Hello, rolls sync pservers back to its checkpoint and goes on. What is measured here, from outside:

- ``down_s``: from the kill until the new process answers ``Stats`` (its start: imports, the checkpoint;
  polled, so within a fraction of a second);
- from the trainers' own push records (:func:`recovery_of`): each trainer that still had pushes for it
  re-synced when its first push sent there after the kill was answered (one that had pushed all its steps
  before the kill has nothing to re-sync). ``recovery_s``: from the kill to the last of those;
  ``resync_s``: from the first of them to the last (the trainers finding the new process and saying
  Hello, rolling back, pushing again), ``sessions_per_s`` = ``trainers_resynced`` / ``resync_s``.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Optional

import numpy as np

from harness.processes import RunFailed


def wait_for(ready: Callable[[], bool], deadline: float, what: str, poll: float = 0.05) -> float:
    """Poll ``ready()`` until true; the monotonic time it was. RunFailed past ``deadline``."""
    while not ready():
        if time.monotonic() > deadline:
            raise RunFailed(f"{what}: deadline passed")
        time.sleep(poll)
    return time.monotonic()


def kill_mid_run(
    victim,
    restart: Callable[[], object],
    stats: Callable[[], Optional[object]],
    pushes_before_kill: int,
    deadline: float,
) -> dict:
    """SIGKILL ``victim`` (a :class:`harness.processes.Command`) once ``stats()`` (its StatsReply, None while
    it does not answer) shows ``pushes_before_kill`` pushes, start it again with ``restart()`` and wait until
    it answers; (pushes counted, when killed and up, monotonic, and ``down_s``)."""

    def pushes() -> int:
        reply = stats()
        return -1 if reply is None else reply.pushes

    wait_for(lambda: pushes() >= pushes_before_kill, deadline, "the pushes before the kill")
    counted = pushes()
    os.killpg(victim.proc.pid, signal.SIGKILL)
    victim.proc.wait(10)
    killed = time.monotonic()
    restart()
    up = wait_for(lambda: stats() is not None, deadline, "the restarted pserver's Stats", poll=0.1)
    return {"killed_after_pushes": counted, "killed_at": killed, "up_at": up, "down_s": round(up - killed, 2)}


def recovery_of(fault: dict, pushes: np.ndarray, victim: int) -> dict:
    """``fault`` (:func:`kill_mid_run`'s) completed from ``pushes``, every push of the run as (trainer,
    pserver index, step, start, end) on the machine's monotonic clock: for each trainer, its first push to
    the ``victim`` sent after the kill (so answered by the new process: one answered by the old process
    just before it died may be recorded a little after); the last of those is when every trainer had
    re-synced."""
    after = pushes[(pushes[:, 1] == victim) & (pushes[:, 3] > fault["killed_at"])]
    if not after.size:
        return {**fault, "trainers_resynced": 0}
    by_end = after[np.lexsort((after[:, 4], after[:, 0]))]  # by trainer, then by answer
    firsts = by_end[np.unique(by_end[:, 0], return_index=True)[1], 4]
    first, last = float(firsts.min()), float(firsts.max())
    return {
        **fault,
        "trainers_resynced": int(firsts.size),
        "recovery_s": round(last - fault["killed_at"], 2),
        "resync_s": round(last - first, 2),
        "sessions_per_s": round(firsts.size / max(last - first, 1e-3), 1),
    }
