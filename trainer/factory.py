"""Trainer: the one type a training script names; ``Trainer(program)`` makes the kind the plan asks for.

A plan for pservers makes a :class:`~trainer.pserver_trainer.PserverTrainer`,
a collective plan a :class:`~trainer.collective.CollectiveTrainer`; both are
Trainers (``isinstance(tr, Trainer)`` holds: each is registered here), as
``pathlib.Path(...)`` makes a ``PosixPath`` or a ``WindowsPath``. One
training script serves both modes. What the kinds share is
:class:`~trainer.trainer_base.TrainerBase`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, Dict, Iterable, Iterator, Mapping, Optional

import torch
from torch.utils.data import Dataset, DistributedSampler

from transpiler import TrainerProgram
from transpiler.position import Position

from .collective import CollectiveTrainer
from .pserver_trainer import PserverTrainer


class Trainer(ABC):
    """One trainer process of a transpiled program: ``Trainer(program, security=None, local_rank=None,
    local_world_size=None, init_method=None)``.

    Returns a :class:`~trainer.pserver_trainer.PserverTrainer` (mode
    ``"pserver"``: gradients pushed to pservers, parameters pulled back) or a
    :class:`~trainer.collective.CollectiveTrainer` (mode ``"collective"``:
    DDP among the trainers), built with these arguments; see each for what
    construction does and what it offers. Train with ``tr.model``, call
    ``tr.step()`` after each backward, and ``tr.close()`` (or use ``with``)
    when done.
    """

    model: torch.nn.Module  # the model to train: forward and backward on it, then step()

    def __new__(cls, program: TrainerProgram = None, *args, **kwargs):
        kind = (
            CollectiveTrainer
            if isinstance(program, TrainerProgram) and program.collective
            else PserverTrainer
        )
        # Built whole here: the kinds are Trainers by registration, so Python runs no __init__ after this.
        return kind(program, *args, **kwargs)

    # What every kind offers (the interface; each kind documents its own behaviour).

    @abstractmethod
    def step(self, *args, **kwargs) -> int:
        """Apply this step's gradients everywhere and zero them; returns the number of steps taken."""

    @abstractmethod
    def pull(self) -> None:
        """Make ``model``'s parameters the job's current ones."""

    @abstractmethod
    def state_dict(self, with_tables: bool = False) -> Dict[str, torch.Tensor]:
        """The trained model as a plain ``state_dict``."""

    @abstractmethod
    def batches(
        self, loader: Iterable, epochs: int, prefetch: Optional[Callable[[object], Dict[str, object]]] = None
    ) -> Iterator:
        """The items of ``loader`` for ``epochs`` epochs, from this trainer's data position on."""

    @abstractmethod
    def sampler(self, dataset: Dataset, **kwargs) -> DistributedSampler:
        """This process's shard of ``dataset``: a ``DistributedSampler`` over every process of every node."""

    @abstractmethod
    def log_scalars(self, values: Mapping[str, float], step: Optional[int] = None) -> None:
        """Write the script's scalars (``{"loss": loss.item()}``) to TensorBoard at ``step`` (default:
        step_count)."""

    @abstractmethod
    def close(self) -> None:
        """Leave the job. Idempotent; leaving a ``with`` block closes too."""

    @property
    @abstractmethod
    def step_count(self) -> int:
        """Steps taken so far (after a roll-back: the checkpoint's step)."""

    @property
    @abstractmethod
    def position(self) -> Position:
        """This trainer's data position (epoch, batches done in it) after its last step."""


Trainer.register(PserverTrainer)
Trainer.register(CollectiveTrainer)
