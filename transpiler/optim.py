"""Optimizers by name: the plain-data spec pservers rebuild a torch optimizer from.

:class:`OptimizerSpec` names a ``torch.optim`` class, its keyword arguments and
an optional learning-rate schedule; :class:`LrSchedule` turns the schedule into
the learning rate of any training step, exactly as torch computes it.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence

import torch

# name -> (torch.optim class, defaults we add on top of torch's own)
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, {}),
    # Paddle's "momentum" optimizer: SGD whose momentum defaults to 0.9, not 0.
    "momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "adagrad": (torch.optim.Adagrad, {}),
    "rmsprop": (torch.optim.RMSprop, {}),
}

# Schedules that change only the learning rate (no momentum cycling), stepped
# once per training step.
LR_SCHEDULERS = {
    name: getattr(torch.optim.lr_scheduler, name)
    for name in (
        "StepLR",
        "MultiStepLR",
        "ExponentialLR",
        "CosineAnnealingLR",
        "LinearLR",
        "ConstantLR",
        "PolynomialLR",
    )
}

# Keyword arguments that would change the numerics or the execution engine on
# the pserver in ways the trainer cannot see; refused to keep updates exact.
_REFUSED_KWARGS = {"params", "foreach", "fused", "capturable", "differentiable"}


def _check_kwargs(what: str, cls: type, kwargs: Dict[str, object], skip: Iterable[str]) -> None:
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self"} - set(skip)
    unknown = sorted(set(kwargs) - accepted)
    if unknown:
        raise ValueError(f"{what} does not take {unknown}; it accepts {sorted(accepted)}")


@dataclass
class OptimizerSpec:
    """A torch optimizer by name, its keyword arguments, and an lr schedule.

    ``name`` is one of :data:`OPTIMIZERS`; ``kwargs`` are the torch class's own
    keyword names (``lr``, ``momentum``, ``weight_decay``, ``betas``, ``eps``...).
    ``lr_scheduler`` names a class of ``torch.optim.lr_scheduler`` from
    :data:`LR_SCHEDULERS`, built with ``lr_scheduler_kwargs`` and stepped once
    per training step, exactly as a single-process loop that calls
    ``optimizer.step(); scheduler.step()`` would.
    """

    name: str = "sgd"
    kwargs: Dict[str, object] = field(default_factory=dict)
    lr_scheduler: Optional[str] = None
    lr_scheduler_kwargs: Dict[str, object] = field(default_factory=dict)

    # name -> (torch class, extra defaults); subclasses name other optimizers.
    registry = OPTIMIZERS
    what = "optimizer"

    def __post_init__(self) -> None:
        if self.name not in self.registry:
            raise ValueError(f"unknown {self.what} {self.name!r}; choose one of {sorted(self.registry)}")
        cls, extra = self.registry[self.name]
        self.kwargs = {**extra, **dict(self.kwargs)}
        # betas travel through JSON as lists; torch wants a tuple.
        if "betas" in self.kwargs:
            self.kwargs["betas"] = tuple(self.kwargs["betas"])
        self._check_optimizer_kwargs(cls)
        if self.lr_scheduler is not None:
            if self.lr_scheduler not in LR_SCHEDULERS:
                raise ValueError(
                    f"unknown lr_scheduler {self.lr_scheduler!r}; choose one of {sorted(LR_SCHEDULERS)}"
                )
            _check_kwargs(
                f"lr_scheduler {self.lr_scheduler!r}",
                LR_SCHEDULERS[self.lr_scheduler],
                self.lr_scheduler_kwargs,
                {"optimizer", "verbose"},
            )
        # Build once on a throwaway tensor so bad values fail here, in the
        # user's process, not later on a pserver.
        self.build([torch.zeros(1, requires_grad=True)])
        LrSchedule(self).lr_at(1)

    def _check_optimizer_kwargs(self, cls: type) -> None:
        _check_kwargs(f"{self.what} {self.name!r} ({cls.__name__})", cls, self.kwargs, _REFUSED_KWARGS)

    @property
    def torch_class(self) -> type:
        return self.registry[self.name][0]

    def build(self, params: Sequence[torch.Tensor]) -> torch.optim.Optimizer:
        """Return a fresh torch optimizer over ``params`` with this spec's kwargs."""
        return self.torch_class(list(params), **self.kwargs)

    def to_dict(self) -> dict:
        kwargs = {k: list(v) if isinstance(v, tuple) else v for k, v in self.kwargs.items()}
        return {
            "name": self.name,
            "kwargs": kwargs,
            "lr_scheduler": self.lr_scheduler,
            "lr_scheduler_kwargs": dict(self.lr_scheduler_kwargs),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "OptimizerSpec":
        return cls(**data)


class LrSchedule:
    """Learning rate as a function of the training step, from a torch scheduler.

    ``lr_at(s)`` is the rate a single-process loop uses for its step ``s``
    (0-based): the scheduler's value after ``s`` calls of ``scheduler.step()``.
    Values are computed by stepping the real torch scheduler on a dummy
    optimizer and cached, so the pserver matches torch exactly.
    """

    def __init__(self, spec: OptimizerSpec):
        self._spec = spec
        self._lrs: List[float] = []
        self._opt = None
        self._sched = None
        self._constant: Optional[float] = None

    def lr_at(self, step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        if self._spec.lr_scheduler is None:
            if self._constant is None:  # once: reading torch's default lr inspects a signature
                kwargs = self._spec.kwargs
                self._constant = float(kwargs["lr"] if "lr" in kwargs else self._default_lr())
            return self._constant
        if self._sched is None:
            self._opt = self._spec.build([torch.zeros(1, requires_grad=True)])
            cls = LR_SCHEDULERS[self._spec.lr_scheduler]
            self._sched = cls(self._opt, **self._spec.lr_scheduler_kwargs)
            self._lrs.append(float(self._opt.param_groups[0]["lr"]))
        while len(self._lrs) <= step:
            self._opt.step()  # keeps torch from warning about step order
            self._sched.step()
            self._lrs.append(float(self._opt.param_groups[0]["lr"]))
        return self._lrs[step]

    def _default_lr(self) -> float:
        return inspect.signature(self._spec.torch_class.__init__).parameters["lr"].default
