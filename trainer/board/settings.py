"""Where, from which processes and how often a job writes TensorBoard scalars: the config's fields, else
variables.

Each setting comes from its :class:`~transpiler.DistributeTranspilerConfig` field when that is set, else
from the variable a launcher or deployment sets for every role (``ps-launch --tensorboard_dir`` sets
``PS_TENSORBOARD_DIR``), else its default (off, trainer 0 only, every 20 steps). A field wins over the
variable, as ``metrics_port`` does over ``PS_METRICS_PORT``: a value written for this job is more specific
than one given to every process. Pure: the environment is passed in, and nothing here imports torch
(``ps-launch`` reads the variable names from here).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

from transpiler.config import TENSORBOARD_TRAINERS, DistributeTranspilerConfig

DIR_VAR = "PS_TENSORBOARD_DIR"
TRAINERS_VAR = "PS_TENSORBOARD_TRAINERS"
EVERY_VAR = "PS_TENSORBOARD_EVERY"
DEFAULT_TRAINERS = "first"
DEFAULT_EVERY = 20


@dataclass(frozen=True)
class BoardSettings:
    """The resolved settings: ``directory`` (None: off), ``trainers`` ("first" or "all"), ``every``
    (steps)."""

    directory: Optional[str]
    trainers: str = DEFAULT_TRAINERS
    every: int = DEFAULT_EVERY

    @classmethod
    def resolve(cls, config: DistributeTranspilerConfig, environ: Mapping[str, str]) -> "BoardSettings":
        """The settings of ``config``, its None fields filled from ``environ``.

        A variable that is malformed raises ValueError naming it (before the
        trainer joins anything, so bad input changes nothing).
        """
        directory = config.tensorboard_dir
        if directory is None:
            directory = environ.get(DIR_VAR, "").strip() or None
        trainers = config.tensorboard_trainers
        if trainers is None:
            trainers = environ.get(TRAINERS_VAR, "").strip().lower() or DEFAULT_TRAINERS
            if trainers not in TENSORBOARD_TRAINERS:
                raise ValueError(
                    f"{TRAINERS_VAR}={environ[TRAINERS_VAR]!r} is not one of {TENSORBOARD_TRAINERS} "
                    f"(first: trainer 0's first process writes; all: every trainer process)"
                )
        every = config.tensorboard_every
        if every is None:
            text = environ.get(EVERY_VAR, "").strip()
            if text and (not text.isdigit() or int(text) < 1):
                raise ValueError(f"{EVERY_VAR}={environ[EVERY_VAR]!r} is not a number of steps >= 1")
            every = int(text) if text else DEFAULT_EVERY
        return cls(directory, trainers, every)

    def writes(self, rank: int) -> bool:
        """Whether the process of global ``rank`` writes: the board is on, and it is rank 0 or all write."""
        return self.directory is not None and (self.trainers == "all" or rank == 0)


def run_name(trainer_id: int, local_rank: int) -> str:
    """The subdirectory (TensorBoard's "run") of a trainer process: ``trainer-<id>``, ``trainer-<id>.<local
    rank>``."""
    return f"trainer-{trainer_id}" + (f".{local_rank}" if local_rank else "")
