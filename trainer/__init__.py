"""Trainer: local forward/backward, gradients pushed to and parameters pulled from pservers.

Public surface::

    from trainer import Trainer
    tr = Trainer(transpiler.get_trainer_program())   # a CollectiveTrainer for a collective plan

The names are imported on first use, so ``ps-launch`` (``trainer.launch``),
which needs none of them, starts without importing torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Public name: the module that defines it.
_EXPORTS = {
    "Trainer": ".trainer", "CollectiveTrainer": ".collective", "PserverError": ".communicator",
    "PserverUnavailableError": ".communicator", "FencedError": ".communicator", "NodeError": ".node.group",
}
__all__ = ["Trainer", "CollectiveTrainer", "PserverError", "PserverUnavailableError", "FencedError", "NodeError"]

if TYPE_CHECKING:
    from .collective import CollectiveTrainer
    from .communicator import FencedError, PserverError, PserverUnavailableError
    from .node.group import NodeError
    from .trainer import Trainer


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
