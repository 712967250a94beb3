"""StepMeter: a trainer's step time split (compute / inside ``step()``), steps and examples, over a window
of steps.

``compute`` is the time between two steps: from the end of one ``step()`` to the start of the next, where
the script reads data and runs forward and backward. ``inside`` is the time in ``step()``: in pserver mode
the push, the wait (sync: for the other trainers) and the pull; in collective mode the optimizer step
(DDP's all-reduce ran in backward). Examples are those of the batches ``Trainer.batches()`` yielded
(:func:`batch_size`), counted when the step that trains one ends: a batch read and not trained (a loop that
breaks) counts nothing. Everything runs on the training thread: no lock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional

import torch


def batch_size(item: object) -> int:
    """Examples in a batch: dim 0 of ``item`` if it is a tensor (or array), else of its first tensor.

    A tuple or list is searched in order, a dict by its values in order (one
    level of nesting each); 0 when no tensor is found, so such batches count
    no examples.
    """
    size = _dim0(item)
    if size is not None:
        return size
    parts = item.values() if isinstance(item, dict) else item if isinstance(item, (tuple, list)) else ()
    for part in parts:
        size = _dim0(part)
        if size is None and isinstance(part, (tuple, list, dict)):
            size = batch_size(part) or None
        if size is not None:
            return size
    return 0


def _dim0(value: object) -> Optional[int]:
    """dim 0 of a tensor or array (1 for a 0-dim one); None for anything else."""
    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() else 1
    shape = getattr(value, "shape", None)  # numpy arrays and the like
    if isinstance(shape, tuple) and all(isinstance(d, int) for d in shape):
        return shape[0] if shape else 1
    return None


@dataclass(frozen=True)
class Window:
    """What the steps of one window took: counts, seconds of wall time, compute and inside ``step()``."""

    steps: int
    examples: int
    seconds: float
    compute: float
    inside: float

    def scalars(self, inside_tag: str) -> Dict[str, float]:
        """The periodic tags: rates over the window, and the mean split of a step in milliseconds."""
        out = {
            "throughput/steps_per_s": self.steps / self.seconds if self.seconds > 0 else 0.0,
            "step_time/compute_ms": 1000.0 * self.compute / self.steps,
            inside_tag: 1000.0 * self.inside / self.steps,
        }
        if self.examples:  # batches that could be sized (Trainer.batches)
            out["throughput/examples_per_s"] = self.examples / self.seconds if self.seconds > 0 else 0.0
        return out


class StepMeter:
    """Sums over the current window; :meth:`take` returns it and starts the next. ``clock``: seconds,
    monotonic."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._stepped = False  # a step ended since construction
        now = clock()
        self._start = self._last_end = now
        self._began: Optional[float] = None
        self._steps = self._examples = 0
        self._batch_examples = 0  # the batches' since the last step, counted when the next step ends
        self._compute = self._inside = 0.0

    def batch(self, examples: int) -> None:
        """A batch of ``examples`` was handed to the script. The first one, before any step, starts the
        clock."""
        if not self._stepped and not self._batch_examples:
            # The script's set-up (loaders, its own start) is not a step's compute time.
            self._start = self._last_end = self._clock()
        self._batch_examples += examples  # several batches per step (accumulation) all count

    def step_begins(self) -> None:
        """``step()`` was entered: the time since the previous one ended was compute."""
        now = self._clock()
        self._compute += now - self._last_end
        self._began = now

    def step_ends(self) -> None:
        """``step()`` returned."""
        now = self._clock()
        self._inside += now - (self._began if self._began is not None else now)
        self._began, self._last_end = None, now
        self._steps += 1
        self._examples += self._batch_examples
        self._batch_examples = 0
        self._stepped = True

    def take(self) -> Optional[Window]:
        """The current window (None if no step ended in it), up to its last step's end; the next one starts
        there."""
        if self._steps == 0:
            return None
        # The window ends where its last step did: time after it (an evaluation, closing) is no step's.
        window = Window(
            self._steps, self._examples, self._last_end - self._start, self._compute, self._inside
        )
        self._start = self._last_end
        self._steps = self._examples = 0
        self._compute = self._inside = 0.0
        return window
