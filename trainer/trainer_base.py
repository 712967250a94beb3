"""TrainerBase: what every kind of trainer shares, whatever its mode.

:class:`~trainer.pserver_trainer.PserverTrainer` and
:class:`~trainer.collective.CollectiveTrainer` derive from it: the step and
data position (:class:`~trainer.steppers.state.StepState`), the batches from
that position (:class:`~trainer.feed.Feed`), the sampler, the TensorBoard
board (:mod:`trainer.board`) and the script's scalars, and closing. Which
kind a plan makes is :class:`trainer.Trainer`'s business (trainer/factory.py).
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Callable, Dict, Iterable, Iterator, List, Mapping, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler

from transpiler import TrainerProgram
from transpiler.position import Position

from .board.pserver_stats import AskStats
from .board.settings import BoardSettings
from .board.writer import NULL_BOARD, open_board, scalar_values
from .feed import Feed
from .memory import retain_freed_memory
from .steppers.state import StepState


class TrainerBase(ABC):
    """One trainer process of a transpiled program, whatever its kind: its step, data position and batches.

    Train with ``tr.model``, call :meth:`step` after each backward, and
    :meth:`close` (or use ``with``) when done.
    """

    def __init__(self, program: TrainerProgram):
        if not isinstance(program, TrainerProgram):
            raise TypeError(f"program must be a TrainerProgram, got {type(program).__name__}")
        if program.model is None:
            raise ValueError("the TrainerProgram carries no model; pass model= to TrainerProgram.from_bytes")
        self.program = program
        self.trainer_id = program.trainer_id
        if program.config.retain_freed_memory:
            retain_freed_memory()
        self.state = StepState()
        self.feed: Optional[Feed] = None
        # Read first: a malformed PS_TENSORBOARD_* variable fails the trainer before it joins anything.
        self._board_settings = BoardSettings.resolve(program.config, os.environ)
        self.board = NULL_BOARD  # each kind opens its own once it knows this process's rank (_open_board)
        self._closed = False
        # Set by the kind of trainer: this process's place among all processes of all trainer nodes.
        self.rank = self.world_size = self.local_rank = self.local_world_size = 0
        self.device = torch.device("cpu")

    @property
    def step_count(self) -> int:
        """Steps taken so far (after a roll-back: the checkpoint's step)."""
        return self.state.step

    @property
    def position(self) -> Position:
        """This trainer's data position (epoch, batches done in it) after its last step."""
        return self.state.position

    # -- training -----------------------------------------------------------

    # step(), pull() and state_dict() are each kind's own (the interface: trainer.Trainer).

    def batches(
        self, loader: Iterable, epochs: int, prefetch: Optional[Callable[[object], Dict[str, object]]] = None
    ) -> Iterator:
        """The items of ``loader`` for ``epochs`` epochs, from this trainer's data position on.

        Train one step per item. Calls ``loader.sampler.set_epoch(epoch)`` when
        there is one (see :meth:`sampler`), reads the next item on a
        background thread with ``read_ahead``, and keeps :attr:`position` at
        (epoch, batches done) after each :meth:`step`. The kinds of trainer
        say what else (data replayed after a roll-back, ``prefetch``).
        """
        self._check_open()
        return self.board.batches(self.feed.batches(loader, epochs, prefetch))

    def sampler(self, dataset: Dataset, **kwargs) -> DistributedSampler:
        """This process's shard of ``dataset``: a ``DistributedSampler`` over every process of every node.

        Keyword arguments go to ``DistributedSampler`` (``shuffle``, ``seed``,
        ``drop_last``); call ``set_epoch`` on it every epoch when shuffling
        (:meth:`batches` does).
        """
        return DistributedSampler(dataset, num_replicas=self.world_size, rank=self.rank, **kwargs)

    # -- TensorBoard --------------------------------------------------------

    def log_scalars(self, values: Mapping[str, float], step: Optional[int] = None) -> None:
        """Write the script's own scalars (``{"loss": loss.item()}``) to this process's TensorBoard run.

        Written at ``step`` (default :attr:`step_count`, the steps taken so
        far), under the tags as given, when this process writes
        (``tensorboard_dir``, ``tensorboard_trainers``; docs/tensorboard.md);
        otherwise nothing is written. Values are real numbers or one-element
        tensors. Bad input raises ValueError either way, and writes nothing.
        """
        self._check_open()
        scalars = scalar_values(values)
        if step is None:
            step = self.state.step
        elif isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be None or an int >= 0, got {step!r}")
        self.board.scalars(scalars, step)

    def _open_board(
        self, inside_tag: str, stats: Optional[AskStats] = None, endpoints: Optional[List[str]] = None
    ) -> None:
        """Open this process's board (once its rank is known); ``inside_tag`` names the time spent in
        ``step()``."""
        self.board = open_board(
            self.program.config,
            self.trainer_id,
            self.local_rank,
            self.rank,
            inside_tag,
            stats,
            endpoints,
            self._board_settings,
        )

    # -- closing ------------------------------------------------------------

    def close(self) -> None:
        """Leave the job (the kinds of trainer say how). Idempotent."""
        self._shut(patient=True)

    def _shut(self, patient: bool) -> None:
        if self._closed:
            return
        self._closed = True
        self._close(patient)

    @abstractmethod
    def _close(self, patient: bool) -> None:
        """Release what this trainer holds; ``patient``: the job went well, so others may be waited for."""

    @property
    @abstractmethod
    def _name(self) -> str:
        """How logs and errors name this process."""

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self._name} is closed")

    def __enter__(self) -> "TrainerBase":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # Leaving on an exception closes without waiting for others: the job failed here.
        self._shut(patient=exc_type is None)
