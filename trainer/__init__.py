"""Trainer: local forward/backward, gradients pushed to and parameters pulled from pservers.

Public surface::

    from trainer import Trainer
    tr = Trainer(transpiler.get_trainer_program())
"""
from .communicator import FencedError, PserverError, PserverUnavailableError
from .trainer import Trainer

__all__ = ["Trainer", "PserverError", "PserverUnavailableError", "FencedError"]
