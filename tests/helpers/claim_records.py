"""Backup trainers' Claim answers as the trainers of tests/scripts/recovery_job.py record them
(``--record_claims``), and the model they say the job must have trained."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Tuple

import torch

from harness.models import FLOAT64_JOB
from tests.scripts import recovery_job


def read_records(out: Path) -> Tuple[Dict[int, List[dict]], Dict[int, int]]:
    """({trainer: the steps it went through, in order, its restarts' appended}, {trainer: its final step})."""
    steps: Dict[int, List[dict]] = {}
    final: Dict[int, int] = {}
    for t in range(recovery_job.TRAINERS):
        steps[t] = []
        for line in (out / f"claims-{t}.jsonl").read_text().splitlines():
            row = json.loads(line)
            if "final_step" in row:
                final[t] = row["final_step"]
            else:
                steps[t].append(row)
    return steps, final


def made_steps(steps: Dict[int, List[dict]], reformed: bool = False) -> Dict[int, Tuple[int, ...]]:
    """{step: the trainers that made it}: what the last Claim answer of each trainer's step says, the same
    for every trainer. Without ``reformed`` every answer of a step names one set; with it, a step whose set
    left before pushing may have been answered with that set first (the trainers dropped from it)."""
    sets: Dict[int, set] = {}
    for t, rows in steps.items():
        for row in rows:
            answers = row["replies"]
            for admitted, trainers in answers if not reformed else answers[-1:]:
                sets.setdefault(row["step"], set()).add(tuple(trainers))
                assert admitted == (t in trainers), (t, row)
    assert all(len(v) == 1 for v in sets.values()), {k: v for k, v in sets.items() if len(v) > 1}
    return {step: v.pop() for step, v in sets.items()}


def assert_last_trainer_fed_each_set(out: Path, steps: Dict[int, List[dict]], final: Dict[int, int]) -> None:
    """The model the last trainer to step saved equals one process fed, at each step, the batches of the
    trainers that made it (float64). A trainer that finished before it may have pulled while the other's
    step was half applied (a sync pull waits for its own step, no later one): not compared."""
    made = made_steps(steps, reformed=True)
    batch_of = {(u, r["step"]): (r["epoch"], r["batch"]) for u, rows in steps.items() for r in rows}
    last = max(final.values())
    expected = recovery_job.reference_of_steps(
        [[(u, *batch_of[u, step]) for u in made[step]] for step in range(last)]
    )
    for t in [t for t, f in final.items() if f == last]:
        state = torch.load(out / f"trainer-{t}.pt", weights_only=True)
        for k in expected:
            torch.testing.assert_close(state[k], expected[k], **FLOAT64_JOB, msg=lambda m: f"{t} {k}: {m}")
