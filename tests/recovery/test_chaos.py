"""Chaos: SIGKILLs at random moments of a sync job, overlapping ones included.

A seeded schedule kills pservers (two within a second of each other, one while
the trainers roll the others back, more at random) and starts each again with
the same command; the job must finish with the model of an uninterrupted run.
``PS_CHAOS_SEEDS=1,2,3`` picks the seeds (printed, so a failure replays); the suite runs seed 1 of
each variant (about 30-40 s each), campaigns run many.
"""

from __future__ import annotations

import os
import random
import time
from typing import List, Tuple

import pytest
import torch

from harness.models import FLOAT64_EXACT
from tests.helpers.jobs import Job, assert_job_models_close
from tests.scripts import recovery_job

pytestmark = pytest.mark.processes

SEEDS = [int(s) for s in os.environ.get("PS_CHAOS_SEEDS", "1").split(",") if s.strip()]
EPOCHS = 12  # 240 steps of 2 trainers
STEP_DELAY = 0.05  # about 13 s of training, before the time recovery adds (see run_chaos's calm)


# (when, seconds after it, role, index) of one SIGKILL. ``when``: "now" (right after the previous
# kill), "up" (once every pserver serves again: the trainers are re-syncing and rolling pservers
# back), or "progress" (once training has gone five steps past the last checkpoint). Role
# TRAINERS+PSERVER: both trainers killed, then pserver ``index`` killed and started again while they
# are down (it resumes from an older checkpoint than the other stands at), then the trainers.
Kill = Tuple[str, float, str, int]


def pserver_schedule(seed: int) -> List[Kill]:
    """Five pserver kills, overlapping ones included."""
    rng = random.Random(seed)
    first = rng.randrange(2)
    return [
        ("progress", rng.uniform(0.0, 1.5), "PSERVER", first),  # mid-run
        ("now", rng.uniform(0.2, 0.8), "PSERVER", 1 - first),  # the other one within a second
        ("up", rng.uniform(0.0, 0.3), "PSERVER", rng.randrange(2)),  # while the others are rolled back
        ("progress", rng.uniform(0.0, 1.0), "PSERVER", rng.randrange(2)),
        ("now", rng.uniform(0.0, 2.0), "PSERVER", rng.randrange(2)),  # maybe during its restart
    ]


def mixed_schedule(seed: int) -> List[Kill]:
    """Pserver and trainer kills: a trainer killed during a roll-back, another mid-step, a pserver
    restarted while both trainers are down."""
    rng = random.Random(seed)
    return [
        ("progress", rng.uniform(0.0, 1.5), "PSERVER", rng.randrange(2)),
        ("up", rng.uniform(0.0, 0.3), "TRAINER", rng.randrange(2)),  # during the roll-back
        ("progress", rng.uniform(0.0, 1.0), "TRAINER", rng.randrange(2)),
        ("progress", rng.uniform(0.0, 1.0), "TRAINERS+PSERVER", rng.randrange(2)),
        ("progress", rng.uniform(0.0, 1.0), "PSERVER", rng.randrange(2)),
        ("now", rng.uniform(0.2, 0.8), "PSERVER", rng.randrange(2)),
    ]


def checkpoint_steps(job: Job) -> List[int]:
    return (
        sorted(int(d.split("-")[1]) for d in os.listdir(job.ckpt) if d.startswith("step-"))
        if os.path.isdir(job.ckpt)
        else []
    )


def serving(job: Job, index: int) -> bool:
    """Whether the latest process of pserver ``index`` serves (its log says so)."""
    latest = max(k for k in job.logs if k.startswith(f"pserver{index}."))
    return "serving" in job.log(latest)


def restart_pserver_with_trainers_down(job: Job, index: int, seed: int) -> None:
    """Kill both trainers, kill and start pserver ``index`` again, and once it serves start the trainers."""
    for t in range(2):
        job.kill(f"trainer{t}")
    job.kill(f"pserver{index}")
    job.start("PSERVER", index)
    job.wait_until(lambda: serving(job, index), f"seed {seed}: pserver {index} up with both trainers down")
    for t in range(2):
        job.start("TRAINER", t)


def run_chaos(job: Job, plan: List[Kill], seed: int, calm: bool = True) -> None:
    """Play ``plan`` on ``job`` (each killed role started again with the same command), then wait for the end.

    ``calm``: once the last kill is done, the trainers drop their step delay (PAUSE_DIR/calm) and
    finish at full speed; False keeps the delay to the end."""
    print(f"chaos seed {seed}: {[(w, round(d, 2), f'{r.lower()}{i}') for w, d, r, i in plan]}")
    job.start_all()
    for when, delay, role, index in plan:
        if when == "up":
            job.wait_until(lambda: serving(job, 0) and serving(job, 1), f"seed {seed}: both pservers up")
        elif when == "progress":
            last = max(checkpoint_steps(job), default=0)
            job.wait_until(
                lambda: max(checkpoint_steps(job), default=0) >= max(last, 5) + 5,
                f"seed {seed}: training past step {max(last, 5) + 5}",
            )
        time.sleep(delay)
        alive = [job.procs[f"trainer{t}"].poll() is None for t in range(2)]
        assert all(alive), f"seed {seed}: the job ended before the chaos did\n{job.all_logs()}"
        if role == "TRAINERS+PSERVER":
            restart_pserver_with_trainers_down(job, index, seed)
            continue
        job.kill(f"{role.lower()}{index}")
        job.start(role, index)
    if calm:
        (job.pause / "calm").touch()
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 180) == 0, f"seed {seed}: {name} failed\n{job.all_logs(first=name)}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_sync_job_survives_overlapping_pserver_kills_with_the_model_of_an_uninterrupted_run(tmp_path, seed):
    job = Job(
        tmp_path,
        args=[
            "--epochs",
            str(EPOCHS),
            "--step_delay",
            str(STEP_DELAY),
            "--checkpoint_every",
            "5",
            *recovery_job.FLOAT64,
        ],
    )
    try:
        run_chaos(job, pserver_schedule(seed), seed)
    finally:
        job.close()
    expected = recovery_job.reference(epochs=EPOCHS, dtype=torch.float64)
    assert_job_models_close(job.out, expected, detail=lambda: f"seed {seed}")


# Lanes: a model of 17 MB in float64 (its pushes stream and split), at an lr small enough that rounding stays
# rounding over 240 steps (its 57k-wide layer sums; at 0.05 mean-of-halves against whole-batch drifts apart).
LANES_ARGS = [
    "--epochs",
    str(EPOCHS),
    "--checkpoint_every",
    "5",
    "--hidden",
    str(recovery_job.WIDE),
    "--lr",
    "0.002",
    "--push_lanes",
    "3",
    "--no_shared_memory",
    *recovery_job.FLOAT64,
]


@pytest.fixture(scope="module")
def uninterrupted_in_lanes(tmp_path_factory) -> dict:
    """Trainer 0's model after the lanes job ran with nothing killed."""
    job = Job(tmp_path_factory.mktemp("uninterrupted"), args=LANES_ARGS)
    try:
        job.start_all()
        for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
            assert job.wait(name, 180) == 0, f"uninterrupted: {name} failed\n{job.all_logs(first=name)}"
    finally:
        job.close()
    return torch.load(job.out / "trainer-0.pt")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("seed", SEEDS)
def test_sync_job_in_lanes_survives_overlapping_pserver_kills_with_the_model_of_an_uninterrupted_run(
    tmp_path, seed, uninterrupted_in_lanes
):
    """As above, every push split across three connections per pserver (``push_lanes``), through gRPC only: a
    killed pserver leaves pushes half-received, and their retries must still count each step once."""
    job = Job(tmp_path, args=LANES_ARGS + ["--step_delay", str(STEP_DELAY)])
    try:
        run_chaos(job, pserver_schedule(seed), seed)
    finally:
        job.close()
    for tid in range(2):  # each trainer split its pushes to each pserver
        log = job.log(f"trainer{tid}.0")
        assert log.count("split across lanes: 3 connections") >= 2, log[-3000:]
    for tid in range(2):
        state = torch.load(job.out / f"trainer-{tid}.pt")
        for k in uninterrupted_in_lanes:
            torch.testing.assert_close(
                state[k],
                uninterrupted_in_lanes[k],
                **FLOAT64_EXACT,
                msg=lambda m: f"seed {seed}, trainer {tid}, {k}, against uninterrupted: {m}",
            )
    single = recovery_job.reference(epochs=EPOCHS, lr=0.002, hidden=recovery_job.WIDE, dtype=torch.float64)
    assert_job_models_close(job.out, single, detail=lambda: f"seed {seed}, against one process")


def accuracy(state: dict) -> float:
    model = recovery_job.build_model()
    model.load_state_dict(state)
    x, y = recovery_job.dataset().tensors
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def backup_bar() -> float:
    """The lowest accuracy a model of one trainer's batches per step passes through after its first epoch.

    Such a model swings: one trainer's batches alone reach 0.51-0.66 (trainer 1) and 0.52-0.65
    (trainer 0) after 2-7 epochs, 0.71 and 0.68 after all 12. A backup run mixes the two trainers'
    batches in an order the kills decide, and a trainer saves the model when it finishes, wherever
    the swing then stands: of 300 simulated random mixes, the lowest point within 15 steps of the
    end was 0.59 at worst (median 0.67), and one chaos run in CI ended at 0.587. So the bar is the
    low point of both references from the second epoch on (0.506; untrained 0.23): a model the kills
    broke, reset or left untrained is below it, a trained one of any mix above.
    """
    return min(
        accuracy(recovery_job.reference(epochs=e, trainers=(t,)))
        for t in (0, 1)
        for e in range(2, EPOCHS + 1)
    )


# The modes the pserver-and-trainer variant runs in: their job arguments.
MODES = {"sync": [], "geo": ["--async", "--k_steps", "4"], "backup": ["--backup_trainers", "1"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", sorted(MODES))
def test_job_survives_pserver_and_trainer_kills_and_trains_as_well(tmp_path, seed, mode):
    """Killed trainers rejoin (or are dropped after heartbeat_timeout and rejoin) and the job ends.

    The model differs from an uninterrupted run's: a survivor trains some steps alone, and a
    trainer that outlives the other finishes its data alone (GEO: a killed trainer also loses
    its steps since its last sync). So the bar is what an uninterrupted sync run reaches in a
    third of its epochs (0.70 here; untrained 0.23, all epochs 0.92). With one backup trainer of
    two, each step is made of the first trainer to claim it and the other's batch is dropped, and
    which one claims depends on the kills: see :func:`backup_bar`.
    """
    job = Job(
        tmp_path,
        args=[
            "--epochs",
            str(EPOCHS),
            "--step_delay",
            str(STEP_DELAY),
            "--checkpoint_every",
            "5",
            "--heartbeat_timeout",
            "3",
            *MODES[mode],
        ],
    )
    try:
        # Dropped and rejoining trainers: the pace stays the one this test was tuned for to the end.
        run_chaos(job, mixed_schedule(seed), seed, calm=False)
    finally:
        job.close()
    bar = backup_bar() if mode == "backup" else accuracy(recovery_job.reference(epochs=EPOCHS // 3))
    for tid in range(2):
        got = accuracy(torch.load(job.out / f"trainer-{tid}.pt"))
        assert got >= bar, f"{mode}, seed {seed}, trainer {tid}: accuracy {got:.3f}, below the bar {bar:.3f}"
