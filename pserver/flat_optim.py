"""FlatOptimizer: a torch optimizer's update of blocks that are views of one flat tensor, its state flat too.

:class:`pserver.store.BlockStore` keeps each dtype's blocks in one tensor
(:mod:`pserver.flat`). The optimizer's state per block (``exp_avg``, ``sum``,
``momentum_buffer``...) lies in one tensor per key at the same offsets, and its
step counts in one tensor, a count per block. An update is one call of torch's
own functional optimizer (``torch.optim.adam.adam``, ``sgd.sgd``,
``adagrad.adagrad``, ``rmsprop.rmsprop``, ``adamw.adamw``: the functions the
``torch.optim`` classes call, with the keyword arguments their constructor
settles, ``foreach`` off as on CPU): over the whole flat tensors when every
block has a gradient and their state is alike (the same step count; SGD's
momentum started in all or none), else over the views of the blocks that have
one, as torch skips a parameter whose ``grad`` is None.

Why one call over the whole buffer equals today's call per block, bit for bit: every supported optimizer
acts element by element, and torch's float32/float64 CPU kernels compute an element alike whether it falls
in a vectorised body or a scalar tail (the same premise that makes row blocks on pservers equal one
process's whole parameters; ``tests/pserver/test_flat_store.py`` checks it). Their 16-bit kernels do not
(the vector path works in float32 with fused operations, the scalar tail rounds in between), so blocks of
a 16-bit dtype always take the per-block views; so does a zero ``eps``, under which the padding between
blocks would turn 0/0 into NaN (elsewhere it stays zero: a zero gradient moves a zero parameter by zero).
Tested with torch 2.13; the functions are found by name and given the keywords their signature takes, as
in torch >= 2.1.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from transpiler.optim import OptimizerSpec

from .flat import FlatLayout

# The lists the functional forms take, in order after (params, grads): a state key each ("step": the counts).
_LISTS = {
    "SGD": ("momentum_buffer",),
    "Adam": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
    "AdamW": ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step"),
    "Adagrad": ("sum", "step"),
    "RMSprop": ("square_avg", "grad_avg", "momentum_buffer", "step"),
}
_EXACT_FLAT = (torch.float32, torch.float64)


def flat_is_exact(dtype: torch.dtype) -> bool:
    """Whether element-wise torch ops on one flat tensor of ``dtype`` equal the same ops block by block."""
    return dtype in _EXACT_FLAT


@dataclass(frozen=True)
class _Kind:
    """What a torch optimizer keeps per parameter: its state keys in torch's order, their initial values,
    whether the state exists before the first step (Adagrad), and the key torch creates from the first
    gradient instead (SGD's momentum)."""

    keys: Tuple[str, ...]
    fill: Dict[str, float]
    eager: bool = False
    lazy: Optional[str] = None


def _kind(name: str, group: dict) -> _Kind:
    if name == "SGD":
        on = group["momentum"] != 0
        return _Kind(("momentum_buffer",) if on else (), {}, lazy="momentum_buffer" if on else None)
    if name in ("Adam", "AdamW"):
        return _Kind(
            ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()), {}
        )
    if name == "Adagrad":
        return _Kind(("step", "sum"), {"sum": float(group["initial_accumulator_value"])}, eager=True)
    if name == "RMSprop":
        keys = ("step", "square_avg") + (("momentum_buffer",) if group["momentum"] > 0 else ())
        return _Kind(keys + (("grad_avg",) if group["centered"] else ()), {})
    raise NotImplementedError(f"no flat form of torch optimizer {name}")


def _functional(cls: type, group: dict) -> Tuple[Callable, dict]:
    """The functional form ``cls.step`` calls, and the keywords it takes from ``group`` (lr set per call)."""
    fn = getattr(sys.modules[cls.__module__], cls.__name__.lower())
    accepted = inspect.signature(fn).parameters
    kwargs = {k: v for k, v in group.items() if k in accepted and k != "params"}
    if "betas" in group:
        kwargs["beta1"], kwargs["beta2"] = group["betas"]
    kwargs.update({k: False for k in ("foreach", "fused", "capturable", "differentiable") if k in accepted})
    return fn, kwargs


class FlatOptimizer:
    """``spec``'s torch optimizer over the blocks of ``param`` (a flat tensor of ``layout``).

    :meth:`step` updates the blocks that have a gradient; :meth:`state_of` and :meth:`load` read and
    write a block's state in the form ``torch.optim`` keeps it (a checkpoint's). Not thread-safe.
    """

    def __init__(self, spec: OptimizerSpec, param: torch.Tensor, layout: FlatLayout):
        cls = spec.torch_class
        group = dict(spec.build([torch.zeros(1, requires_grad=True)]).param_groups[0])
        self.kind = _kind(cls.__name__, group)
        self._fn, self._kwargs = _functional(cls, group)
        self._lists = _LISTS[cls.__name__]
        self.layout, self.param = layout, param
        n = len(layout)
        self.counts_steps = "step" in self.kind.keys
        self.state = {
            k: torch.full_like(param, self.kind.fill.get(k, 0.0)) for k in self.kind.keys if k != "step"
        }
        scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32  # torch's own
        self.steps = torch.zeros(n, dtype=scalar)
        self._step = torch.zeros((), dtype=scalar)  # the count every block shares while they are alike
        self.started = np.full(n, self.kind.eager, dtype=bool)  # whether torch would hold state for the block
        self._alike = True
        self.whole = flat_is_exact(param.dtype) and group.get("eps", 1.0) != 0
        self._params = [layout.view(i, param) for i in range(n)]
        self._views = {k: [layout.view(i, t) for i in range(n)] for k, t in self.state.items()}
        self._counts = [self.steps[i] for i in range(n)]  # 0-dim views: the functional form counts in place

    def step(self, grad: torch.Tensor, present: Optional[np.ndarray], lr: float) -> None:
        """One step on the blocks ``present`` (None: all) with ``grad`` (a flat tensor of the layout) at
        ``lr``."""
        if (present is None or present.all()) and self.whole and self._alike:
            self._step_all(grad, lr)
            return
        which = range(len(self.layout)) if present is None else [int(i) for i in np.flatnonzero(present)]
        self.step_blocks(which, [self.layout.view(i, grad) for i in which], lr)

    def step_blocks(self, which: Sequence[int], grads: Sequence[torch.Tensor], lr: float) -> None:
        """One step on blocks ``which`` (positions in the layout) with ``grads`` (each in its block's shape)
        at ``lr``: the functional call over their views."""
        if not which:
            return
        lazy = self.kind.lazy
        lists: List[list] = [[self._params[i] for i in which], list(grads)]
        for key in self._lists:
            if key == "step":
                lists.append([self._counts[i] for i in which])
            elif key == lazy:
                lists.append([self._views[key][i] if self.started[i] else None for i in which])
            else:
                lists.append([self._views[key][i] for i in which] if key in self.state else [])
        self._fn(*lists, **{**self._kwargs, "lr": lr})
        if lazy is not None:  # torch made the buffers of blocks without one: they go where the state lives
            made = lists[2 + self._lists.index(lazy)]
            for j, i in enumerate(which):
                if not self.started[i]:
                    self._views[lazy][i].copy_(made[j])
        self.started[list(which)] = True
        self._settle()

    def _step_all(self, grad: torch.Tensor, lr: float) -> None:
        lazy = self.kind.lazy
        lists: List[list] = [[self.param], [grad]]
        for key in self._lists:
            if key == "step":
                lists.append([self._step])
            elif key == lazy:
                lists.append([self.state[key] if self.started[0] else None])
            else:
                lists.append([self.state[key]] if key in self.state else [])
        self._fn(*lists, **{**self._kwargs, "lr": lr})
        if lazy is not None and not self.started[0]:
            self.state[lazy].copy_(lists[2 + self._lists.index(lazy)][0])
        if self.counts_steps:
            self.steps.add_(1)
        self.started[:] = True

    def _settle(self) -> None:
        """After blocks stepped apart: whether they are alike again (one count; SGD's momentum started in all
        or none, the one state whose start changes the arithmetic)."""
        started = self.kind.lazy is None or self.started.all() or not self.started.any()
        self._alike = bool(started and (not self.counts_steps or bool((self.steps == self.steps[0]).all())))
        if self._alike and self.counts_steps and len(self.layout):
            self._step.copy_(self.steps[0])

    def state_of(self, i: int) -> Dict[str, object]:
        """Block i's state as torch keeps it ({} before its first step), its tensors views of the flat
        state."""
        if not self.started[i]:
            return {}
        return {
            k: self._counts[i] if k == "step" else self.layout.view(i, self.state[k]) for k in self.kind.keys
        }

    def check(self, i: int, state: dict) -> None:
        """Raise ValueError if block i cannot take ``state`` (a checkpoint's, as torch keeps it)."""
        if not state:
            return
        name, numel = self.layout.names[i], self.layout.dense.numels[i]
        for key in self.kind.keys:
            if key not in state:
                if key == self.kind.lazy:
                    continue  # torch starts it from the next gradient, as for a block never stepped
                raise ValueError(f"the checkpoint's optimizer state of block {name} has no {key!r}")
            value = state[key]
            if key != "step" and (not torch.is_tensor(value) or value.numel() != numel):
                raise ValueError(
                    f"the checkpoint's {key!r} of block {name} does not fit its {numel} elements"
                )

    def load(self, i: int, state: dict) -> None:
        """Set block i's state from ``state`` (checked by :meth:`check`; {}: as before any step)."""
        with torch.no_grad():
            for key, views in self._views.items():
                if state and key in state:
                    views[i].copy_(state[key].reshape(views[i].shape))
                else:
                    views[i].fill_(self.kind.fill.get(key, 0.0))
            self.steps[i] = float(state["step"]) if state and self.counts_steps else 0.0
        lazy = self.kind.lazy
        self.started[i] = self.kind.eager or bool(
            state and self.kind.keys and (lazy is None or lazy in state)
        )
        self._settle()
