"""Sparse optimizers of distributed tables: torch's updates for sparse gradients, on row batches.

Functional cores in the style of ``torch.optim._functional``: each takes the
gathered rows of one step (``param``, its state arrays, ``grad``; all
``(k, dim)`` numpy arrays of the table's dtype, ids unique) and updates them in
place. :class:`SparseRule` binds a table's optimizer spec (torch's defaults
filled in) to one of them; :class:`pserver.tables.shard.TableShard` gathers, calls the
rule and scatters back.

The arithmetic is torch's, operation by operation, in the table's dtype
(Python-float hyper-parameters are rounded to that dtype exactly where torch
rounds them), so a shard matches ``nn.Embedding(sparse=True)`` trained by
``torch.optim.SGD`` / ``Adagrad`` / ``SparseAdam`` to float rounding:

- sgd: ``param += (-lr) * g`` (``param.add_(grad, alpha=-lr)``)
- adagrad (``_single_tensor_adagrad``, sparse branch):
  ``clr = lr / (1 + (step - 1) * lr_decay)``; ``state_sum += g * g``;
  ``param += (-clr) * (g / (sqrt(state_sum) + eps))``
- adam (``torch.optim._functional.sparse_adam``): ``m_upd = (g - m) * (1 - b1)``;
  ``m += m_upd``; ``v_upd = (g * g - v) * (1 - b2)``; ``v += v_upd``;
  ``param += -(lr * sqrt(1 - b2**step) / (1 - b1**step)) * ((m_upd + m_old) / (sqrt(v_upd + v_old) + eps))``

``step`` is the per-table step count after this step's increment, as torch
keeps per parameter: it advances on every step the table had a gradient, even
when none of its ids were on this shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, Sequence, Tuple

import numpy as np

__all__ = ["sgd", "adagrad", "sparse_adam", "SparseRule", "make_rule", "STATE_NAMES"]

# Names of the per-row state arrays of each optimizer, as torch names them in
# ``optimizer.state[p]``; also their file names in a checkpoint.
STATE_NAMES: Dict[str, Tuple[str, ...]] = {
    "sgd": (),
    "adagrad": ("sum",),
    "adam": ("exp_avg", "exp_avg_sq"),
}


def sgd(param: np.ndarray, grad: np.ndarray, *, lr: float) -> None:
    """Plain SGD on gathered rows, in place: ``param += (-lr) * grad``.

    torch adds ``alpha * grad`` with ``alpha = -lr`` rounded to the
    parameter's dtype, which is what multiplying by a dtype scalar does here.
    """
    param += param.dtype.type(-lr) * grad


def adagrad(
    param: np.ndarray,
    state_sum: np.ndarray,
    grad: np.ndarray,
    *,
    lr: float,
    step: int,
    lr_decay: float,
    eps: float,
) -> None:
    """Adagrad's sparse-gradient update on gathered rows, in place.

    ``step`` is the count after this step's increment (torch increments before
    computing ``clr``); the accumulator grows by ``grad**2`` only on the given
    rows, and the update divides by ``sqrt(accumulator) + eps`` of those rows.
    """
    clr = lr / (1 + (step - 1) * lr_decay)
    state_sum += grad * grad
    std = np.sqrt(state_sum)
    std += param.dtype.type(eps)
    np.divide(grad, std, out=std)
    std *= param.dtype.type(-clr)
    param += std


def sparse_adam(
    param: np.ndarray,
    exp_avg: np.ndarray,
    exp_avg_sq: np.ndarray,
    grad: np.ndarray,
    *,
    lr: float,
    step: int,
    beta1: float,
    beta2: float,
    eps: float,
) -> None:
    """``torch.optim.SparseAdam``'s update on gathered rows, in place.

    The moments decay only on the given rows, written as torch writes them
    (``old += (1 - b) * (new - old)``), and the step size carries the bias
    corrections of the per-table ``step`` (after its increment). An empty
    batch changes nothing, as torch skips an empty gradient.
    """
    if grad.shape[0] == 0:
        return
    t = param.dtype.type
    m_upd = grad - exp_avg
    m_upd *= t(1 - beta1)
    exp_avg += m_upd
    v_upd = grad * grad
    v_upd -= exp_avg_sq
    v_upd *= t(1 - beta2)
    exp_avg_sq += v_upd
    # torch forms numer = m_upd + m_old and denom from v_upd + v_old rather
    # than reading the stored moments back; IEEE addition commutes, so those
    # are bitwise the stored m_old + m_upd and v_old + v_upd used here.
    denom = np.sqrt(exp_avg_sq, out=v_upd)
    denom += t(eps)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr * math.sqrt(bias_correction2) / bias_correction1
    update = np.divide(exp_avg, denom, out=m_upd)
    update *= t(-step_size)
    param += update


@dataclass(frozen=True)
class SparseRule:
    """A table's optimizer with its hyper-parameters bound (torch's defaults filled in).

    ``state_names`` / ``state_init`` give the per-row state arrays and the
    value a new row's state starts at; ``update(param, states, grad, lr, step)``
    runs the functional core on gathered rows.
    """

    name: str
    state_names: Tuple[str, ...]
    state_init: Tuple[float, ...]
    hyper: Dict[str, float]
    _core: Callable[..., None]

    def scalars(self, lr: float, step: int, dtype: np.dtype) -> np.ndarray:
        """The scalars of one step in ``dtype``, rounded where the functions above round them (for the
        compiled updates, :mod:`pserver.tables.compiled.row_kernels`): sgd ``-lr``; adagrad ``eps``, ``-clr``;
        adam ``1 - beta1``, ``1 - beta2``, ``eps``, ``-step_size``; padded to 4, then ``state_init``."""
        t, h = dtype.type, self.hyper
        if self.name == "sgd":
            out = [t(-lr)]
        elif self.name == "adagrad":
            out = [t(h["eps"]), t(-(lr / (1 + (step - 1) * h["lr_decay"])))]
        else:
            size = lr * math.sqrt(1 - h["beta2"] ** step) / (1 - h["beta1"] ** step)
            out = [t(1 - h["beta1"]), t(1 - h["beta2"]), t(h["eps"]), t(-size)]
        out += [t(0)] * (4 - len(out)) + [t(v) for v in self.state_init]
        return np.array(out + [t(0)] * (6 - len(out)), dtype)

    def update(
        self, param: np.ndarray, states: Sequence[np.ndarray], grad: np.ndarray, lr: float, step: int
    ) -> None:
        """Apply one step to gathered rows in place (``step`` counted after increment)."""
        if self.name == "sgd":
            self._core(param, grad, lr=lr)
        else:
            self._core(param, *states, grad, lr=lr, step=step, **self.hyper)


def make_rule(name: str, kwargs: Dict[str, object]) -> SparseRule:
    """Bind optimizer ``name`` ("sgd" | "adagrad" | "adam") and the user's ``kwargs``.

    Fills torch's defaults (adagrad ``lr_decay=0``, ``initial_accumulator_value=0``,
    ``eps=1e-10``; SparseAdam ``betas=(0.9, 0.999)``, ``eps=1e-8``); ``lr`` in
    ``kwargs`` is ignored because the caller passes each step's (scheduled) rate.
    """
    if name == "sgd":
        return SparseRule("sgd", (), (), {}, sgd)
    if name == "adagrad":
        hyper = {"lr_decay": float(kwargs.get("lr_decay", 0.0)), "eps": float(kwargs.get("eps", 1e-10))}
        init = float(kwargs.get("initial_accumulator_value", 0.0))
        return SparseRule("adagrad", STATE_NAMES["adagrad"], (init,), hyper, adagrad)
    if name == "adam":
        beta1, beta2 = kwargs.get("betas", (0.9, 0.999))
        hyper = {"beta1": float(beta1), "beta2": float(beta2), "eps": float(kwargs.get("eps", 1e-8))}
        return SparseRule("adam", STATE_NAMES["adam"], (0.0, 0.0), hyper, sparse_adam)
    raise ValueError(f"unknown table optimizer {name!r}; choose one of {sorted(STATE_NAMES)}")
