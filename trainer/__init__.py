"""Trainer: local forward/backward, gradients pushed to and parameters pulled from pservers.

Public surface::

    from trainer import Trainer
    tr = Trainer(transpiler.get_trainer_program())   # a PserverTrainer, or a CollectiveTrainer for a
                                                     # collective plan: both are Trainers

The names are imported on first use, so ``ps-launch`` (``trainer.launch``),
which needs none of them, starts without importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from transpiler.lazy import lazy_exports

__getattr__ = lazy_exports(
    __name__,
    {  # public name: the module that defines it
        "Trainer": ".factory",
        "PserverTrainer": ".pserver_trainer",
        "CollectiveTrainer": ".collective",
        "PserverError": ".errors",
        "PserverUnavailableError": ".errors",
        "FencedError": ".errors",
        "NodeError": ".node.group",
    },
)
__all__ = [
    "Trainer",
    "PserverTrainer",
    "CollectiveTrainer",
    "PserverError",
    "PserverUnavailableError",
    "FencedError",
    "NodeError",
]

if TYPE_CHECKING:
    from .collective import CollectiveTrainer
    from .errors import FencedError, PserverError, PserverUnavailableError
    from .factory import Trainer
    from .node.group import NodeError
    from .pserver_trainer import PserverTrainer
