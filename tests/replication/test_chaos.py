"""Hot standby under chaos: seeded SIGKILLs of primaries and backups while a job trains.

Every shard runs on two processes (tests/helpers/replicated_job.py) and etcd, started as its own
process, decides who leads. A seeded schedule kills, one at a time, the primary or the backup of a
shard, starts it again at once with the same command, and waits until the shard is back to an
in-sync pair before the next kill (never both replicas of a shard at once). Sync: the final model
equals single-process training and no trainer or pserver rolled back. Async: the parameters count
every push applied to them (recovery_job --counting), so every acknowledged push of every trainer is
in the final model exactly once. ``PS_REPLICA_CHAOS_SEEDS=1,2,3`` picks the seeds (the suite runs
seed 1 of each); campaigns run many.
"""

from __future__ import annotations

import os
import random
from typing import List, Optional, Tuple

import pytest
import torch

from pserver.checkpoint.layout import find_saved, load_blocks
from tests.helpers.claim_records import assert_last_trainer_fed_each_set, made_steps, read_records
from tests.helpers.etcd import etcd_fixture  # noqa: F401
from tests.helpers.replicated_job import ReplicatedJob
from tests.scripts import recovery_job

pytestmark = pytest.mark.processes

SEEDS = [int(s) for s in os.environ.get("PS_REPLICA_CHAOS_SEEDS", "1").split(",") if s.strip()]
EPOCHS = 60  # 1200 steps of each trainer
STEP_DELAY = 0.05  # the kills land while the job trains; the rest runs at full speed
KILL_AT = 42  # the step before which a whole shard dies (its checkpoint: step 40)
KILLS = 4


def schedule(seed: int, shards: int = 2, roles=("primary", "backup")) -> List[Tuple[int, str, int]]:
    """(shard, "primary" or "backup", updates the shard applies first) of each kill."""
    rng = random.Random(seed)
    return [(rng.randrange(shards), rng.choice(roles), rng.randint(3, 20)) for _ in range(KILLS)]


def updates_of(job: ReplicatedJob, name: str) -> int:
    stats = job.stats(name)
    return -1 if stats is None else stats.step


def assert_replicas_agreed(job: ReplicatedJob) -> None:
    """Every digest a backup compared matched its primary's, and backups did compare some."""
    logs = {k: job.log(k) for k in job.logs}
    assert not [k for k, text in logs.items() if "differs from the primary's" in text]
    assert sum("matches the primary's" in text for text in logs.values()) >= len(job.endpoints)


def assert_ended_cleanly(job: ReplicatedJob) -> None:
    """Every pserver process exited 0 once the trainers closed, nothing rolled back, and the replicas'
    digests agreed."""
    codes = job.finish_pservers()
    assert set(codes.values()) == {0}, (codes, job.all_logs())
    assert job.rollback_lines() == []
    assert_replicas_agreed(job)


def assert_counted_once(job: ReplicatedJob, kills: List[str], value: float, pushes: int) -> None:
    """A --counting job ended cleanly, and what each shard's primary saved once every trainer had closed
    holds ``value`` in every element (each acknowledged push once: none twice, no fewer) after ``pushes``
    pushes."""
    assert_ended_cleanly(job)
    final = find_saved(job.ckpt, sync_mode=False)
    for shard in range(len(job.endpoints)):
        for entries in load_blocks([final.parts[shard]]).values():
            for block in entries:
                assert torch.equal(block["value"], torch.full_like(block["value"], value)), (shard, kills)
        assert final.manifests[shard]["step"] == pushes


def run_chaos(job: ReplicatedJob, seed: int, kills: Optional[List[Tuple[int, str, int]]] = None) -> List[str]:
    """Start the job, kill and restart processes per ``kills`` (default ``schedule(seed)``); the kills, as
    "name (role)"."""
    job.start_all()
    for shard in range(len(job.endpoints)):
        job.wait_in_sync(shard)
    done = []
    for shard, role, after in kills if kills is not None else schedule(seed):
        for k in range(len(job.endpoints)):
            job.wait_in_sync(k)
        primary, backup = job.roles(shard)
        start = updates_of(job, primary)
        # Training goes on a while: the kill lands mid-step, wherever that is.
        job.wait_until(lambda: updates_of(job, primary) >= start + after, f"{after} updates on {primary}")
        victim = primary if role == "primary" else backup
        job.kill(victim)
        job.restart(victim)
        done.append(f"{victim} ({role} of shard {shard})")
    for k in range(len(job.endpoints)):
        job.wait_in_sync(k)
    (job.pause / "calm").touch()
    return done


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_sync_job_with_primaries_and_backups_killed_equals_one_process_and_never_rolls_back(
    etcd, tmp_path, seed
):
    job = ReplicatedJob(
        tmp_path,
        etcd.url,
        args=["--epochs", str(EPOCHS), "--step_delay", str(STEP_DELAY), *recovery_job.FLOAT64],
    )
    try:
        kills = run_chaos(job, seed)
        job.wait_trainers(180)
        print(f"seed {seed}: killed {kills}")
        job.assert_trained_as_one_process(epochs=EPOCHS)
        assert_ended_cleanly(job)
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_async_job_with_primaries_and_backups_killed_keeps_every_acknowledged_push_once(etcd, tmp_path, seed):
    job = ReplicatedJob(
        tmp_path,
        etcd.url,
        args=["--async", "--counting", "--epochs", str(EPOCHS), "--step_delay", str(STEP_DELAY)],
    )
    steps = EPOCHS * recovery_job.SAMPLES // recovery_job.TRAINERS // recovery_job.BATCH
    try:
        kills = run_chaos(job, seed)
        job.wait_trainers(180)
        print(f"seed {seed}: killed {kills}")
        # Each trainer finished all its steps, each acknowledged: trainer 0's pushes, TALLY x trainer 1's.
        assert_counted_once(job, kills, -(steps + recovery_job.TALLY * steps), pushes=2 * steps)
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_geo_job_with_primaries_and_backups_killed_keeps_every_acknowledged_sync_once(etcd, tmp_path, seed):
    """GEO (k_steps=4) under hot standby: a sync is an ordinary push, acknowledged once the backup holds it.
    --counting: each local step moves every element by -TALLY**t, a sync pushes the window's sum and the
    pservers add it halved (2 trainers), so the final blocks are -(steps + TALLY * steps) / 2 exactly:
    every sync applied once whatever primary died, none twice; 5 syncs per trainer and epoch."""
    k = 4
    job = ReplicatedJob(
        tmp_path,
        etcd.url,
        args=[
            "--async",
            "--k_steps",
            str(k),
            "--counting",
            "--epochs",
            str(EPOCHS),
            "--step_delay",
            str(STEP_DELAY),
        ],
    )
    steps = EPOCHS * recovery_job.SAMPLES // recovery_job.TRAINERS // recovery_job.BATCH
    try:
        kills = run_chaos(job, seed)
        job.wait_trainers(180)
        print(f"seed {seed}: killed {kills}")
        # One push per window of each trainer, its sum halved by the pservers.
        assert_counted_once(job, kills, -(steps + recovery_job.TALLY * steps) / 2, pushes=2 * steps // k)
    finally:
        job.close()


@pytest.mark.timeout(300)
def test_a_shard_that_loses_both_processes_recovers_from_its_checkpoint_as_without_replicas(etcd, tmp_path):
    """Checkpoints stay the last resort: both processes of shard 1 SIGKILLed at once and started again.
    Neither is in the in-sync list, so after replica_takeover_timeout one leads from the checkpoint under a
    new lineage; the trainers roll every shard back to it (shard 0's backup copies its rolled-back primary
    again), and the job ends with the model of an uninterrupted run."""
    # Every trainer waits before step KILL_AT while shard 1 dies: both shards have applied steps
    # 0..KILL_AT-1, and shard 1's latest checkpoint (every 5 steps) is two steps behind, so the trainers
    # must roll shard 0 back to it, whatever the machine's load.
    job = ReplicatedJob(
        tmp_path,
        etcd.url,
        args=[
            "--epochs",
            str(EPOCHS // 2),
            "--step_delay",
            str(STEP_DELAY),
            "--takeover_timeout",
            "3",
            "--pause_at",
            str(KILL_AT),
            "--pause_every_trainer",
            *recovery_job.FLOAT64,
        ],
    )
    try:
        job.start_all()
        for shard in range(len(job.endpoints)):
            job.wait_in_sync(shard)
        for trainer_id in range(job.n_trainers):
            job.wait_file(f"reached-{trainer_id}", timeout=120)
        primary, _ = job.roles(1)
        assert updates_of(job, primary) == KILL_AT
        job.kill("pserver1")
        job.kill("replica1")
        job.restart("pserver1")
        job.restart("replica1")
        for shard in range(len(job.endpoints)):
            job.wait_in_sync(shard, timeout=90)
        (job.pause / "calm").touch()
        (job.pause / "go").touch()
        job.wait_trainers(240)
        job.assert_trained_as_one_process(epochs=EPOCHS // 2)
        logs = "\n".join(job.log(k) for k in job.logs)
        assert "leading from its own state" in logs  # the checkpoint recovery of shard 1
        assert job.rollback_lines()  # and the trainers rolled back to it
        assert_replicas_agreed(job)
        codes = job.finish_pservers()
        assert set(codes.values()) == {0}, (codes, job.all_logs())
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_backup_trainers_with_the_claiming_primary_killed_equal_one_process_fed_each_steps_set(
    etcd, tmp_path, seed
):
    """backup_trainers=1 of 2 under hot standby: shard 0 decides every step's trainers, and its primary (or
    backup) is SIGKILLed mid-run. Every Claim answer of a step, retries on the new primary included, names
    the same set; the final model equals one process fed, at each step, the batches of the trainers that
    made it (float64), and nothing rolls back."""
    job = ReplicatedJob(
        tmp_path,
        etcd.url,
        args=[
            "--epochs",
            str(EPOCHS),
            "--step_delay",
            str(STEP_DELAY),
            "--backup_trainers",
            "1",
            "--record_claims",
            *recovery_job.FLOAT64,
        ],
    )
    try:
        kills = run_chaos(job, seed, schedule(seed, shards=1, roles=("primary", "primary", "backup")))
        job.wait_trainers(180)
        print(f"seed {seed}: killed {kills}")
        steps, final = read_records(job.out)
        made_steps(steps)  # no trainer dies here: every answer of a step names one set
        assert_last_trainer_fed_each_set(job.out, steps, final)
        assert_ended_cleanly(job)
    finally:
        job.close()
