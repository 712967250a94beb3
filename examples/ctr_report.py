"""What the CTR example (train_ctr.py) reports while it trains: its result line, the examples/s of its timed
steps, the job's training AUC and mean loss every few steps, and a progress bar.

Logged under ``train_ctr`` as the example's own lines are: the tests and the launcher's console read them.
"""

from __future__ import annotations

import json
import logging
import sys
import time

import torch

log = logging.getLogger("train_ctr")


def result_line(role: str, score: float, steps: int, mode: str, target: float) -> str:
    """The run's last line; tests and the launcher's console look for ``test AUC <score>``."""
    return f"{role}: test AUC {score:.4f} after {steps} steps ({mode} mode, target {target:.2f})"


class Throughput:
    """Examples/s of the steps after ``warmup``; logged, and printed as a RESULT line for benchmarks."""

    def __init__(self, warmup: int, role: str):
        self.warmup, self.role = warmup, role
        self.steps = self.examples = 0
        self.start = self.end = None

    def step(self, n: int) -> None:
        self.steps += 1
        if self.steps == self.warmup:
            self.start = time.time()
        elif self.steps > self.warmup:
            self.examples += n
            self.end = time.time()

    def report(self) -> None:
        if self.start is None or self.end is None:
            return
        rate = self.examples / max(self.end - self.start, 1e-9)
        log.info(
            "%s: %d timed examples in %.2f s: %.0f examples/s",
            self.role,
            self.examples,
            self.end - self.start,
            rate,
        )
        print(
            "RESULT "
            + json.dumps(
                {"role": self.role, "examples": self.examples, "start": self.start, "end": self.end}
            ),
            flush=True,
        )


class JobCurves:
    """Every ``every`` steps, the job's training AUC and mean loss over those steps, reduced over every
    trainer.

    Each trainer adds its batches' scores and losses; at each multiple of ``every`` of its step count it
    sends them through a pserver (trainer/job_metrics.py) and starts over. With TensorBoard on they are the
    curves ``job/train_auc`` and ``job/loss_mean``. Every trainer makes the same rounds (round = step //
    every), so a faster async trainer waits there for the others; a trainer that has closed is not waited
    for, and a round already passed (batches replayed after a roll-back) is skipped.
    """

    def __init__(self, every: int):
        from trainer import job_metrics

        self.every, self.metrics = every, job_metrics
        self.auc = job_metrics.AucStats()
        self.loss_sum, self.batches, self.last_round = 0.0, 0, 0

    def add(self, logits: torch.Tensor, labels: torch.Tensor, loss: torch.Tensor) -> None:
        """A trained batch: its logits, 0/1 labels and mean loss."""
        self.auc.update(labels.cpu().numpy(), torch.sigmoid(logits.detach().float()).cpu().numpy())
        self.loss_sum += float(loss)
        self.batches += 1

    def maybe_reduce(self, tr, role: str, report: bool) -> None:
        """At a new multiple of ``every`` steps: the job's figures since the last one (logged if
        ``report``)."""
        round_ = tr.step_count // self.every
        if round_ <= self.last_round or not self.batches:
            return
        auc = self.metrics.global_auc(tr, stats=self.auc, name="train_auc", round=round_)
        loss = self.metrics.global_mean(
            tr, "loss", self.loss_sum / self.batches, weight=self.batches, round=round_
        )
        if report:
            log.info(
                "%s: step %d: the job's training AUC %.4f, mean loss %.4f", role, tr.step_count, auc, loss
            )
        self.auc = self.metrics.AucStats()
        self.loss_sum, self.batches, self.last_round = 0.0, 0, round_


def progress(total: int, enabled: bool, batch_size: int, done: int = 0):
    """A tqdm bar over ``total`` steps (``done`` of them already) in examples, with examples/s and the
    loss."""
    from tqdm import tqdm

    return tqdm(
        total=total * batch_size,
        initial=done * batch_size,
        disable=not enabled,
        mininterval=2.0,
        unit="ex",
        unit_scale=True,
        file=sys.stderr,
        desc="train",
    )
