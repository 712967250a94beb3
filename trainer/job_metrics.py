"""Global metrics: a value summed (or its max / min) over every trainer of the job, as Paddle's fleet.metrics.

Each trainer sees only its own data; trainer 0's loss or AUC is not the
job's. These helpers take a trainer's *local statistics* (sums, counts, score
histograms) and return the combination over all trainers, the same on every
trainer::

    from trainer import job_metrics

    auc = job_metrics.AucStats()                   # this trainer's positives / negatives per score bucket
    loss_sum, n = 0.0, 0
    for x, y in tr.batches(loader, epochs=1):
        p = torch.sigmoid(tr.model(x)).squeeze(1)
        loss = F.binary_cross_entropy(p, y)
        loss.backward()
        tr.step()
        auc.update(y, p)
        loss_sum, n = loss_sum + loss.item() * len(y), n + len(y)
    job_auc = job_metrics.global_auc(tr, stats=auc)  # AUC over every trainer's examples
    job_loss = job_metrics.global_mean(tr, "loss", loss_sum / n, weight=n)

Every trainer must make the same calls in the same order: the n-th call
with a given name is round n of that reduction, and it returns once every
live trainer made it (closed or dropped trainers are not waited for; a
missing one fails the call after ``barrier_timeout``, naming it). In pserver
mode the values travel to the job's first pserver (Reduce RPC), which
combines them in float64 in trainer id order: sums of counts are exact up to
2**53 and every trainer gets the very same result. A trainer node's local
processes combine theirs first; collective trainers all-gather among
themselves. A trainer restarted mid-job counts its rounds from 0 again: pass
``round=`` (e.g. the epoch) where that can happen.

With TensorBoard on (docs/tensorboard.md), each helper's scalar result is also
written, at the trainer's step, by every process that writes: ``job/<name>``
for :func:`global_auc` (``job/auc`` by default) and ``job/<name>_<op>`` for the
others (``global_mean(tr, "loss", ...)``: ``job/loss_mean``).
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Dict, List, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist

from .collective import CollectiveTrainer
from .steppers.node import NodeStepper

#: Score buckets of :class:`AucStats` (Paddle's default ``num_thresholds``): AUC resolution 1/4095.
DEFAULT_THRESHOLDS = 4095
OPS = {"sum": np.add, "max": np.maximum, "min": np.minimum}

ArrayLike = Union[float, int, np.ndarray, torch.Tensor, Sequence[float]]

_lock = threading.Lock()
# Per trainer object, the next round of each reduction key.
_rounds: "weakref.WeakKeyDictionary[object, Dict[str, int]]" = weakref.WeakKeyDictionary()


def _array(value: ArrayLike, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().double().numpy()
    try:
        return np.array(value, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what} must be a number or an array of numbers, got {type(value).__name__}: {e}"
        ) from None


def _combine(op: str, parts: List[Mapping[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """Combine ``parts`` by ``op`` in list order, in float64 (the pserver does the same over trainers)."""
    out = {name: np.array(v, dtype=np.float64) for name, v in parts[0].items()}
    for part in parts[1:]:
        if {n: v.shape for n, v in part.items()} != {n: v.shape for n, v in out.items()}:
            raise ValueError(f"processes sent different values to combine: {sorted(part)} vs {sorted(out)}")
        for name, v in part.items():
            OPS[op](out[name], v, out=out[name])
    return out


def all_reduce(
    tr, key: str, values: Mapping[str, ArrayLike], op: str = "sum", round: Optional[int] = None
) -> Dict[str, np.ndarray]:
    """``values`` ({name: number or array}) combined by ``op`` ("sum", "max", "min") over every trainer.

    The building block of the other helpers: every trainer calls it with the
    same ``key``, names and shapes; the n-th call of a key is its round n
    (or ``round``, given explicitly). Returns float64 arrays by name.
    Raises ValueError for bad input, and the trainer's PserverError when the
    pserver refuses or others do not come within ``barrier_timeout``.
    """
    if op not in OPS:
        raise ValueError(f"op must be one of {sorted(OPS)}, got {op!r}")
    if not isinstance(key, str) or not key:
        raise ValueError(f"key must be a non-empty string, got {key!r}")
    if round is not None and (isinstance(round, bool) or not isinstance(round, int) or round < 0):
        raise ValueError(f"round must be None or an int >= 0, got {round!r}")
    arrays = {str(name): _array(v, f"value {name!r}") for name, v in values.items()}
    if not arrays:
        raise ValueError("all_reduce needs at least one value")
    with _lock:
        rounds = _rounds.setdefault(tr, {})
        r = rounds.get(key, 0) if round is None else round
    if isinstance(tr, CollectiveTrainer):  # collective mode: no pservers, the processes all-gather
        out: List[Dict[str, np.ndarray]] = [None] * dist.get_world_size()
        dist.all_gather_object(out, arrays)
        result = _combine(op, out)
    else:
        result = _through_pserver(tr, key, r, op, arrays)
    with _lock:
        rounds[key] = r + 1
    return result


def _through_pserver(
    tr, key: str, round_: int, op: str, arrays: Dict[str, np.ndarray]
) -> Dict[str, np.ndarray]:
    """Reduce through the job's first pserver; a node's local ranks combine theirs first."""
    tr._check_open()

    def ask() -> Dict[str, np.ndarray]:
        values = [(n, a.shape, a.ravel().tolist()) for n, a in arrays.items()]
        reply = tr.channels[tr.program.pservers[0]].reduce(key, round_, op, values)
        return {v.name: np.array(v.data, dtype=np.float64).reshape(tuple(v.shape)) for v in reply.values}

    if not isinstance(tr.stepper, NodeStepper):
        return ask()
    group = tr.stepper.group
    arrays = _combine(op, group.all_gather(arrays, f"trainer node {tr.trainer_id}: gathering {key!r}"))
    return tr.stepper.leader_does(f"reduction {key!r}", ask)


def _scalar_or_array(a: np.ndarray, like: np.ndarray) -> Union[float, np.ndarray]:
    return float(a) if like.ndim == 0 else a


def _logged(tr, tag: str, value: Union[float, np.ndarray]) -> Union[float, np.ndarray]:
    """``value``, written to ``tr``'s TensorBoard board as ``tag`` when it is a scalar (arrays are not)."""
    if isinstance(value, float):
        tr.log_scalars({tag: value})
    return value


def global_sum(tr, name: str, value: ArrayLike, round: Optional[int] = None) -> Union[float, np.ndarray]:
    """The sum of ``value`` (a number or an array) over every trainer: a float, or an array of its shape."""
    local = _array(value, "value")
    return _logged(
        tr,
        f"job/{name}_sum",
        _scalar_or_array(all_reduce(tr, f"sum:{name}", {"v": local}, "sum", round)["v"], local),
    )


def global_max(tr, name: str, value: ArrayLike, round: Optional[int] = None) -> Union[float, np.ndarray]:
    """The largest ``value`` over every trainer (elementwise for arrays)."""
    local = _array(value, "value")
    return _logged(
        tr,
        f"job/{name}_max",
        _scalar_or_array(all_reduce(tr, f"max:{name}", {"v": local}, "max", round)["v"], local),
    )


def global_min(tr, name: str, value: ArrayLike, round: Optional[int] = None) -> Union[float, np.ndarray]:
    """The smallest ``value`` over every trainer (elementwise for arrays)."""
    local = _array(value, "value")
    return _logged(
        tr,
        f"job/{name}_min",
        _scalar_or_array(all_reduce(tr, f"min:{name}", {"v": local}, "min", round)["v"], local),
    )


def global_mean(
    tr, name: str, value: ArrayLike, weight: float = 1.0, round: Optional[int] = None
) -> Union[float, np.ndarray]:
    """The mean over every trainer of ``value``, each weighted by its ``weight`` (e.g. its example count).

    With each trainer's mean loss and ``weight`` = its number of examples,
    this is the mean loss over all examples of the job; with the default
    weight, the plain mean of the trainers' values. NaN when the weights sum to 0.
    """
    local = _array(value, "value")
    w = float(weight)
    if not math.isfinite(w) or w < 0:
        raise ValueError(f"weight must be a finite number >= 0, got {weight!r}")
    got = all_reduce(tr, f"mean:{name}", {"sum": local * w, "weight": np.array(w)}, "sum", round)
    total = float(got["weight"])
    mean = got["sum"] / total if total > 0 else np.full(local.shape, math.nan)
    return _logged(tr, f"job/{name}_mean", _scalar_or_array(mean, local))


# -- AUC ------------------------------------------------------------------------------------------


class AucStats:
    """One trainer's positives and negatives per score bucket (Paddle's ``stat_pos`` / ``stat_neg``).

    Scores (probabilities in [0, 1]) fall into ``num_thresholds + 1`` equal
    buckets; AUC from these histograms equals the exact AUC when no two
    examples of different labels share a bucket without sharing a score, and
    is within about 1/``num_thresholds`` of it otherwise. Histograms add up,
    so the job's AUC is that of the summed histograms (:func:`global_auc`).
    """

    def __init__(self, num_thresholds: int = DEFAULT_THRESHOLDS):
        if isinstance(num_thresholds, bool) or not isinstance(num_thresholds, int) or num_thresholds < 1:
            raise ValueError(f"num_thresholds must be an int >= 1, got {num_thresholds!r}")
        self.num_thresholds = num_thresholds
        self.pos = np.zeros(num_thresholds + 1, dtype=np.int64)
        self.neg = np.zeros(num_thresholds + 1, dtype=np.int64)

    def update(self, labels: ArrayLike, scores: ArrayLike) -> None:
        """Add examples: ``labels`` 0/1 (or bool), ``scores`` the predicted probability of label 1.

        For a two-column softmax output pass its second column. Bad input
        (other labels, scores outside [0, 1] or NaN, lengths that differ)
        raises ValueError and adds nothing.
        """
        y = _array(labels, "labels").reshape(-1)
        s = _array(scores, "scores").reshape(-1)
        if y.shape != s.shape:
            raise ValueError(
                f"labels and scores must have the same number of elements, got {y.size} and {s.size}"
            )
        if not np.isin(y, (0.0, 1.0)).all():
            raise ValueError("labels must be 0 or 1")
        if not ((s >= 0) & (s <= 1)).all():  # NaN fails both
            raise ValueError("scores must be probabilities in [0, 1] (apply a sigmoid or softmax first)")
        buckets = np.floor(s * self.num_thresholds).astype(np.int64)
        size = self.num_thresholds + 1
        self.pos += np.bincount(buckets[y == 1], minlength=size)
        self.neg += np.bincount(buckets[y == 0], minlength=size)

    def auc(self) -> float:
        """AUC of this trainer's examples alone."""
        return auc_from_histograms(self.pos, self.neg)


def auc_from_histograms(pos: np.ndarray, neg: np.ndarray) -> float:
    """ROC AUC from positives and negatives per score bucket (bucket order = score order).

    Trapezoids from the highest bucket down, as Paddle's fleet.metrics.auc
    does; examples in one bucket count as tied, as equal scores do in
    ``sklearn.metrics.roc_auc_score``. NaN when there are no positives or no
    negatives (Paddle reports 0.5 there; AUC is undefined).
    """
    pos = np.asarray(pos, dtype=np.float64)[::-1]
    neg = np.asarray(neg, dtype=np.float64)[::-1]
    tp, fp = np.cumsum(pos), np.cumsum(neg)
    total_pos, total_neg = tp[-1] if tp.size else 0.0, fp[-1] if fp.size else 0.0
    if total_pos == 0 or total_neg == 0:
        return math.nan
    tp_before = np.concatenate(([0.0], tp[:-1]))
    area = float(np.sum(neg * (tp_before + tp) / 2.0))
    return area / (total_pos * total_neg)


def global_auc(
    tr,
    labels: Optional[ArrayLike] = None,
    scores: Optional[ArrayLike] = None,
    *,
    stats: Optional[AucStats] = None,
    num_thresholds: int = DEFAULT_THRESHOLDS,
    name: str = "auc",
    round: Optional[int] = None,
) -> float:
    """ROC AUC over every trainer's examples, the same on every trainer.

    Give this trainer's ``labels`` and ``scores`` (probabilities of label 1),
    or the :class:`AucStats` it accumulated over many batches as ``stats``.
    Every trainer must use the same ``num_thresholds``. NaN when the job saw
    only one class.
    """
    if stats is None:
        if labels is None or scores is None:
            raise ValueError("global_auc needs labels and scores, or stats=AucStats")
        stats = AucStats(num_thresholds)
        stats.update(labels, scores)
    elif labels is not None or scores is not None:
        raise ValueError("give labels and scores, or stats, not both")
    got = all_reduce(tr, f"auc:{name}", {"pos": stats.pos, "neg": stats.neg}, "sum", round)
    return _logged(tr, f"job/{name}", auc_from_histograms(got["pos"], got["neg"]))
