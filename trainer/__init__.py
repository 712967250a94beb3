"""Trainer: local forward/backward, gradients pushed to and parameters pulled from pservers.

Public surface::

    from trainer import Trainer
    tr = Trainer(transpiler.get_trainer_program())   # a CollectiveTrainer for a collective plan
"""
from .collective import CollectiveTrainer
from .communicator import FencedError, PserverError, PserverUnavailableError
from .node.group import NodeError
from .trainer import Trainer

__all__ = ["Trainer", "CollectiveTrainer", "PserverError", "PserverUnavailableError", "FencedError", "NodeError"]
