"""The job's configuration: :class:`DistributeTranspilerConfig` (fields and meanings) and its checks."""

from .checks import (
    GRAD_WIRE_DTYPES,
    MIN_BLOCK_SIZE_FLOOR,
    MODE_ALIASES,
    MODES,
    NONFINITE_GRADS,
    SPLIT_METHODS,
    TENSORBOARD_TRAINERS,
)
from .fields import DistributeTranspilerConfig

__all__ = [
    "DistributeTranspilerConfig",
    "GRAD_WIRE_DTYPES",
    "MIN_BLOCK_SIZE_FLOOR",
    "MODE_ALIASES",
    "MODES",
    "NONFINITE_GRADS",
    "SPLIT_METHODS",
    "TENSORBOARD_TRAINERS",
]
