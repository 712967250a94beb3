"""Board: one trainer process's TensorBoard writer, and what feeds it (step times, batches, pserver Stats).

A trainer opens its board at construction (:func:`open_board`): a
:class:`Board` around ``torch.utils.tensorboard.SummaryWriter`` when this
process writes, else a :class:`NullBoard` that does nothing (the board is
off, another process writes, or the ``tensorboard`` package is missing: then
one log line per process says so and how to install it). The trainer tells
the board when each ``step()`` begins and ends and hands it the batches
``batches()`` yields; every ``every`` steps the board writes the window's
rates and step time split and asks its :class:`~trainer.board.pserver_stats.StatsPoller`
(trainer 0's first process only) for a Stats round. The script's own
scalars (``Trainer.log_scalars``) and the job-wide metrics
(:mod:`trainer.job_metrics`) are written at once, at the trainer's step.
Closing writes the last window and a last Stats round, then flushes.
"""

from __future__ import annotations

import logging
import numbers
import os
import threading
from typing import Callable, Dict, Iterator, List, Mapping, Optional

import torch

from transpiler import DistributeTranspilerConfig

from .meter import StepMeter, batch_size
from .pserver_stats import AskStats, StatsPoller
from .settings import BoardSettings, run_name

log = logging.getLogger(__name__)

INSTALL_HINT = 'pip install "torch-pserver[tensorboard]" (or pip install tensorboard)'
FLUSH_SECS = 10  # how stale the file may be while the job runs: TensorBoard shows what is flushed
MAX_QUEUE = 100  # events buffered before the writer thread must take them

_missing_lock = threading.Lock()
_missing_logged = False  # the "not installed" line is logged once per process


def scalar_values(values: Mapping[str, object]) -> Dict[str, float]:
    """``values`` ({tag: number}) as floats, checked: ValueError naming the first bad tag or value.

    A value is a real number (``int``, ``float``, numpy scalar) or a tensor of
    one element (``loss.item()`` is the same and makes the sync explicit).
    NaN and infinities are kept: they are what the script reported.
    """
    if not isinstance(values, Mapping):
        raise ValueError(f"log_scalars takes a mapping of tag -> number, got {type(values).__name__}")
    out = {}
    for tag, value in values.items():
        if not isinstance(tag, str) or not tag.strip():
            raise ValueError(f"a scalar's tag must be a non-empty string, got {tag!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise ValueError(
                    f"scalar {tag!r} must have one element, got a tensor of shape {tuple(value.shape)}"
                )
            value = value.detach().item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"scalar {tag!r} must be a real number, got {type(value).__name__}: {value!r}")
        out[tag] = float(value)
    return out


class NullBoard:
    """The board of a process that writes nothing: every call returns at once."""

    def scalars(self, values: Dict[str, float], step: int) -> None:
        """Write nothing."""

    def batches(self, items: Iterator) -> Iterator:
        """``items`` as they are."""
        return items

    def step_begins(self) -> None:
        """Nothing to time."""

    def step_ends(self, step: int) -> None:
        """Nothing to time."""

    def close(self, step: int, patient: bool) -> None:
        """Nothing to write or close."""


NULL_BOARD = NullBoard()


class Board:
    """One process's writer (see the module doc). ``inside_tag``: what the time inside ``step()`` is
    called."""

    def __init__(
        self,
        writer,
        every: int,
        inside_tag: str,
        stats: Optional[AskStats] = None,
        endpoints: Optional[List[str]] = None,
        clock: Optional[Callable[[], float]] = None,
    ):
        self._writer = writer
        self._every = every
        self._inside_tag = inside_tag
        self._lock = threading.Lock()  # the training thread and the Stats thread both write
        self._closed = False
        self.meter = StepMeter(clock) if clock is not None else StepMeter()
        self.poller = StatsPoller(stats, endpoints or [], self.scalars) if stats is not None else None

    def scalars(self, values: Dict[str, float], step: int) -> None:
        """Write ``values`` ({tag: float}) at ``step`` (queued to the writer's thread; nothing after
        close)."""
        with self._lock:
            if self._closed:
                return
            for tag, value in values.items():
                self._writer.add_scalar(tag, value, step)

    def batches(self, items: Iterator) -> Iterator:
        """``items``, each counted (its examples, :func:`~trainer.board.meter.batch_size`) as it is handed
        out."""
        try:
            for item in items:
                self.meter.batch(batch_size(item))
                yield item
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()

    def step_begins(self) -> None:
        """``step()`` was entered."""
        self.meter.step_begins()

    def step_ends(self, step: int) -> None:
        """``step()`` returned at ``step``: every ``every`` steps, the window's scalars and a Stats round."""
        self.meter.step_ends()
        if step % self._every == 0:
            self._periodic(step)

    def _periodic(self, step: int) -> None:
        window = self.meter.take()
        if window is not None:
            self.scalars(window.scalars(self._inside_tag), step)
        if self.poller is not None:
            self.poller.request(step)

    def close(self, step: int, patient: bool) -> None:
        """The trainer closes at ``step``: the last window and (``patient``: the job went well) a last
        Stats round, then the Stats thread stopped and the event file flushed and closed. Idempotent."""
        with self._lock:
            if self._closed:
                return
        try:
            window = self.meter.take()
            if window is not None:
                self.scalars(window.scalars(self._inside_tag), step)
            if self.poller is not None and patient:
                self.poller.final(step)
        finally:
            if self.poller is not None:
                self.poller.stop()
            with self._lock:
                self._closed = True
            self._writer.close()


def open_board(
    config: DistributeTranspilerConfig,
    trainer_id: int,
    local_rank: int,
    rank: int,
    inside_tag: str,
    stats: Optional[AskStats] = None,
    endpoints: Optional[List[str]] = None,
    settings: Optional[BoardSettings] = None,
):
    """This process's board: a :class:`Board` when it writes, else :data:`NULL_BOARD`.

    ``stats`` (every pserver's Stats, see ``Channels.stats``) is used by rank 0
    only, for the pservers at ``endpoints``. ``settings``: resolved already
    (default: from ``config`` and this process's environment).
    """
    settings = settings or BoardSettings.resolve(config, os.environ)
    if not settings.writes(rank):
        return NULL_BOARD
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        _log_missing(settings.directory, e)
        return NULL_BOARD
    path = os.path.join(settings.directory, run_name(trainer_id, local_rank))
    writer = SummaryWriter(log_dir=path, max_queue=MAX_QUEUE, flush_secs=FLUSH_SECS)
    polls = stats is not None and rank == 0 and bool(endpoints)
    log.info(
        "trainer %d%s: TensorBoard scalars to %s every %d steps%s",
        trainer_id,
        f" local rank {local_rank}" if local_rank else "",
        path,
        settings.every,
        f", with the Stats of {len(endpoints)} pservers" if polls else "",
    )
    return Board(writer, settings.every, inside_tag, stats if polls else None, endpoints)


def _log_missing(directory: str, error: ImportError) -> None:
    global _missing_logged
    with _missing_lock:
        if _missing_logged:
            return
        _missing_logged = True
    log.warning(
        "TensorBoard: tensorboard_dir is %s, but the tensorboard package is not installed (%s): nothing is "
        "written, training goes on; to write it: %s",
        directory,
        error,
        INSTALL_HINT,
    )
