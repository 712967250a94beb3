"""Pserver checkpoints: what one pserver writes, when, and how a job resumes from them.

- :mod:`.layout`: the layout on disk (step directories, parts, manifests), finding the
  latest complete checkpoint, reading blocks back, export for serving.
- :mod:`.checkpointer`: :class:`Checkpointer`, a pserver's saves (every N steps, on demand)
  and loads, its pruning and its record of closed trainers.
- :mod:`.cli`: ``ps-checkpoint list|export``.
"""

from .checkpointer import Checkpointer

__all__ = ["Checkpointer"]
