"""Trainer: the one type a training script names; ``Trainer(program)`` makes the kind the plan asks for.

A plan for pservers makes a :class:`~trainer.pserver_trainer.PserverTrainer`,
a collective plan a :class:`~trainer.collective.CollectiveTrainer`; both are
Trainers (``isinstance(tr, Trainer)`` holds: each is registered here), as
``pathlib.Path(...)`` makes a ``PosixPath`` or a ``WindowsPath``. One
training script serves both modes. What the kinds share is
:class:`~trainer.trainer_base.TrainerBase`.
"""
from __future__ import annotations

from abc import ABC

from transpiler import TrainerProgram

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

    def __new__(cls, program: TrainerProgram = None, *args, **kwargs):
        kind = CollectiveTrainer if isinstance(program, TrainerProgram) and program.collective else PserverTrainer
        # Built whole here: the kinds are Trainers by registration, so Python runs no __init__ after this.
        return kind(program, *args, **kwargs)


Trainer.register(PserverTrainer)
Trainer.register(CollectiveTrainer)
