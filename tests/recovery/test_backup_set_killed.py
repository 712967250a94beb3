"""Backup trainers when a step's whole set dies before pushing it, with real processes: the step is made
again from the live trainers (docs/modes.md, backup trainers).

``backup_trainers=1`` of 2: each step is made of the first trainer to claim it. A seeded trainer, once its
claim of a seeded step (or a later one) is admitted, holds without pushing and is SIGKILLed: the step's
set is dead. The other trainer, dropped from that step, waits until the pservers drop the dead one
(``heartbeat_timeout``), is answered with the step unapplied, claims it again and makes it alone; the
killed trainer is started again once the other went past that step, and rejoins. Every trainer records
its Claim answers (``recovery_job --record_claims``): the model of the last trainer to step equals one
process fed, at each step, the batches of the trainers that made it (float64), and the held step was made
by the survivor. ``PS_CHAOS_SEEDS=1,2,3`` picks the seeds; the suite runs seed 1.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.helpers.claim_records import assert_last_trainer_fed_each_set, made_steps, read_records
from tests.scripts import recovery_job

SEEDS = [int(s) for s in os.environ.get("PS_CHAOS_SEEDS", "1").split(",") if s.strip()]
EPOCHS = 4  # 80 steps of each trainer


@pytest.mark.timeout(240)
@pytest.mark.processes
@pytest.mark.parametrize("seed", SEEDS)
def test_a_step_whose_set_is_killed_before_pushing_is_made_again_by_the_live_trainer(job_factory, seed):
    rng = random.Random(seed)
    victim, hold_from = rng.randrange(recovery_job.TRAINERS), rng.randint(2, 40)
    survivor = 1 - victim
    job = job_factory(
        args=[
            "--epochs",
            str(EPOCHS),
            "--step_delay",
            "0.02",
            "--backup_trainers",
            "1",
            "--record_claims",
            "--hold_after_claim",
            str(hold_from),
            "--pause_trainer",
            str(victim),
            "--heartbeat_interval",
            "0.3",
            "--heartbeat_timeout",
            "2",
            *recovery_job.FLOAT64,
        ]
    )
    job.start_all()
    job.wait_file("claimed")
    held = int((job.pause / "claimed").read_text())
    job.kill(f"trainer{victim}")  # its set dies with it: it pushed nothing of step `held`

    def survivor_passed() -> bool:
        path = job.out / f"claims-{survivor}.jsonl"
        return path.exists() and any(f'"step": {held},' in line for line in path.read_text().splitlines())

    job.wait_until(survivor_passed, f"seed {seed}: trainer {survivor} past step {held}", timeout=60)
    job.start("TRAINER", victim)
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 150) == 0, job.all_logs()
    steps, final = read_records(job.out)
    made = made_steps(steps, reformed=True)
    assert made[held] == (survivor,), (seed, victim, held)
    (row,) = [r for r in steps[survivor] if r["step"] == held]
    assert [tuple(t) for _, t in row["replies"]] == [(victim,), (survivor,)], row  # dropped, then re-formed
    assert_last_trainer_fed_each_set(job.out, steps, final)
