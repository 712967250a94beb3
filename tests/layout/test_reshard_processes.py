"""A job of real processes changes its pserver count while it trains, asked with ``ps-reshard``: 2 -> 3 -> 2
pservers (a new pserver process joins, one leaves), none restarted; then the same with a seeded SIGKILL of
an old owner, the new owner or a trainer during each change, the killed role started again with the same
command. Every run ends with the model of one process on the same data (float64), the record naming the
layout every role ran last, and no change left in progress. Async, with a trainer killed: every
acknowledged push once (the counting model).

``PS_CHAOS_SEEDS=1,2,3`` picks the seeds of the chaos runs (printed, so a failure replays); the suite runs
seed 1 of each victim.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time

import pytest
import torch

from harness.ports import free_ports
from pserver.checkpoint.layout import find_saved, load_blocks
from tests.helpers.jobs import Job
from tests.scripts import recovery_job
from transpiler.layout.record import read_record_file

pytestmark = pytest.mark.processes

SEEDS = [int(s) for s in os.environ.get("PS_CHAOS_SEEDS", "1").split(",") if s.strip()]
# 480 steps, slowed to 0.1 s each until the test writes PAUSE_DIR/calm once its changes are made: a change
# always lands while the job trains, whatever the machine's load.
EPOCHS = 24
# heartbeat_timeout as by default: a role SIGKILLed and started again takes up to ~20 s to start on a loaded
# 2-core machine, and one silent for longer is dropped and the step goes on without it (by design).
SLOW = ["--epochs", str(EPOCHS), "--step_delay", "0.1", "--heartbeat_timeout", "30"]
ARGS = [*recovery_job.FLOAT64, *SLOW]


def checkpoint_steps(job: Job) -> list:
    names = os.listdir(job.ckpt) if os.path.isdir(job.ckpt) else []
    return sorted(int(d.split("-")[1]) for d in names if d.startswith("step-"))


def reshard_command(job: Job, pservers) -> list:
    """``ps-reshard`` for ``pservers``, as an operator runs it."""
    args = ["--checkpoint_dir", job.ckpt, "--pservers", ",".join(pservers), "--timeout", "90"]
    return [sys.executable, "-m", "pserver.layout.reshard_cli", *args]


def reshard(job: Job, pservers) -> subprocess.CompletedProcess:
    return subprocess.run(reshard_command(job, pservers), capture_output=True, text=True, timeout=150)


def trained_past(job: Job, steps: int) -> None:
    """Wait until the job has checkpointed ``steps`` steps past its latest checkpoint now."""
    start = max(checkpoint_steps(job), default=0)
    job.wait_until(lambda: max(checkpoint_steps(job), default=0) >= start + steps, f"{steps} more steps")


def finish(job: Job, pservers) -> None:
    """Every trainer finishes; every pserver process exits 0 (those of the last layout once the trainers
    closed, one that left the job once it told its trainers); the model equals one process's."""
    (job.pause / "calm").touch()  # the rest of the job at full speed
    for tid in range(job.n_trainers):
        assert job.wait(f"trainer{tid}", 120) == 0, job.all_logs(f"trainer{tid}")
    for name in [k for k in job.procs if k.startswith("pserver")]:
        assert job.wait(name, 60) == 0, job.all_logs(name)
    record = read_record_file(job.ckpt)
    assert record.change is None and record.pservers == pservers, record
    job.assert_trained_as_one_process(epochs=EPOCHS)


@pytest.mark.timeout(240)
def test_a_job_of_processes_grows_and_shrinks_with_ps_reshard(tmp_path):
    job = Job(tmp_path, n_pservers=2, args=ARGS)
    try:
        job.start_all()
        a, b = job.endpoints
        grown = [a, b, f"127.0.0.1:{free_ports(1)[0]}"]
        trained_past(job, 10)
        asking = subprocess.Popen(reshard_command(job, grown), stdout=subprocess.PIPE, text=True)
        job.wait_until(lambda: read_record_file(job.ckpt).change is not None, "the change asked")
        job.start("PSERVER", 2, endpoints=grown)  # the new pserver, once asked: joins at the commit
        done = subprocess.CompletedProcess(asking.args, asking.wait(150), asking.communicate()[0], "")
        assert done.returncode == 0, done.stderr + job.all_logs()
        assert "runs layout epoch 1 on 3 pservers" in done.stdout
        trained_past(job, 10)
        refused = reshard(job, [])
        assert refused.returncode == 2 and "at least one pserver" in refused.stderr
        done = reshard(job, [a, b])
        assert done.returncode == 0, done.stderr + job.all_logs()
        assert "runs layout epoch 2 on 2 pservers" in done.stdout
        finish(job, [a, b])
        assert "leaves the job (layout epoch 2)" in job.log("pserver2.0")
    finally:
        job.close()


VICTIMS = ["old owner", "new owner", "trainer"]


def change_twice_with_a_kill(job: Job, victim: str, rng: random.Random) -> list:
    """Grow the started ``job`` from its two pservers to three and shrink it back, ``victim`` SIGKILLed at a
    seeded moment of each change (from the ask to a second after it: before the switch, while the
    pservers stop and write their parts, or while the next layout starts) and started again with the same
    command; a change rolled back is asked again. The two pservers."""
    a, b = job.endpoints
    grown = [a, b, f"127.0.0.1:{free_ports(1)[0]}"]
    for pservers in (grown, [a, b]):
        trained_past(job, 5)
        asking = subprocess.Popen(
            reshard_command(job, pservers), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        job.wait_until(lambda: read_record_file(job.ckpt).change is not None, "the change asked")
        if pservers == grown:
            job.start("PSERVER", 2, endpoints=grown)  # the new pserver, once asked
        time.sleep(rng.uniform(0.0, 1.0))
        now = read_record_file(job.ckpt)
        if victim == "trainer":
            name, role, index, endpoints = f"trainer{rng.randrange(2)}", "TRAINER", None, None
        elif victim == "old owner":
            index = rng.randrange(len(now.pservers))
            name, role, endpoints = f"pserver{index}", "PSERVER", now.pservers if index == 2 else None
        else:  # the pserver the change adds (growing) or removes (shrinking)
            name, role, index, endpoints = "pserver2", "PSERVER", 2, grown
        index = int(name[-1]) if index is None else index
        phase = now.change.phase if now.change is not None else f"committed (epoch {now.epoch})"
        job.kill(name)
        # Started again at once, with the same command, as a supervisor does (one that left exits 0).
        job.start(role, index, endpoints=endpoints)
        out, _ = asking.communicate(timeout=150)
        print(f"{name} killed ({phase}); ps-reshard: {out.strip()}")
        if asking.returncode != 0:  # rolled back as one: asked again
            assert asking.returncode == 1, out
            done = reshard(job, pservers)
            assert done.returncode == 0, done.stdout + done.stderr + job.all_logs()
    return [a, b]


def assert_counted_once(job: Job, value: float) -> None:
    """A ``--counting`` job's last checkpoint (written once every trainer had closed) holds ``value`` in every
    element: each acknowledged push once, none twice, no fewer."""
    final = find_saved(job.ckpt, sync_mode=False)
    for entries in load_blocks(final.parts).values():
        for block in entries:
            assert torch.equal(block["value"], torch.full_like(block["value"], value)), block["value"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("victim", VICTIMS)
def test_a_change_survives_a_sigkill_of_an_old_owner_the_new_owner_or_a_trainer(tmp_path, victim, seed):
    """``victim`` SIGKILLed during each of two changes (:func:`change_twice_with_a_kill`). Each change
    commits or is rolled back as one (then it is asked again); the job ends exact either way."""
    print(f"chaos seed {seed}, victim {victim}")
    job = Job(tmp_path, n_pservers=2, args=ARGS)
    try:
        job.start_all()
        finish(job, change_twice_with_a_kill(job, victim, random.Random(f"{victim}-{seed}")))
    finally:
        job.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
def test_an_async_change_keeps_every_acknowledged_push_once_through_a_sigkill_of_a_trainer(tmp_path, seed):
    """Async (``--counting``: the model counts the pushes applied to it), a trainer SIGKILLed during each
    change: every acknowledged push of each trainer is in the final model exactly once. (A pserver killed
    without a backup loses the async updates since its checkpoint, as in any async job: with hot standby
    those victims are exact too, tests/layout/test_reshard_standby.py.)"""
    print(f"chaos seed {seed}, async, victim trainer")
    job = Job(tmp_path, n_pservers=2, args=["--async", "--counting", *SLOW])
    try:
        job.start_all()
        pservers = change_twice_with_a_kill(job, "trainer", random.Random(f"async-trainer-{seed}"))
        (job.pause / "calm").touch()
        for name in [*(f"trainer{t}" for t in range(job.n_trainers)), *(k for k in job.procs if k[0] == "p")]:
            assert job.wait(name, 120) == 0, job.all_logs(name)
        assert read_record_file(job.ckpt).pservers == pservers
        steps = EPOCHS * recovery_job.SAMPLES // recovery_job.TRAINERS // recovery_job.BATCH
        # Each trainer finished all its steps, each acknowledged: trainer 0's pushes, TALLY x trainer 1's.
        assert_counted_once(job, -(steps + recovery_job.TALLY * steps))
    finally:
        job.close()
