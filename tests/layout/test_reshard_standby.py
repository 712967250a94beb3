"""A hot-standby job (every shard on a primary and a backup, etcd deciding which leads) changes its pserver
count while it trains: 2 -> 3 -> 2 shards asked with ``ps-reshard --replicas``, the new shard coming up with
its backup, the removed one's two processes leaving together. During each change a seeded SIGKILL hits the
primary or the backup of a shard (old or new), from the ask to a second after it, and the process is
started again with the same command. A primary lost before the commit rolls the change back (asked again);
one lost after it fails over to its backup as in any layout. Sync: the model equals one process on the same
data (float64) and no trainer rolled back. Async (``--counting``): every acknowledged push of every trainer
is in the final model exactly once.

``PS_CHAOS_SEEDS=1,2,3`` picks the seeds (printed, so a failure replays); the suite runs seed 1 of each mode.
"""

from __future__ import annotations

import os
import random
import subprocess
import time

import pytest

from harness.ports import free_ports
from tests.helpers.etcd import etcd_fixture  # noqa: F401
from tests.helpers.replicated_job import ReplicatedJob
from tests.layout.test_reshard_processes import assert_counted_once, reshard_command, trained_past
from tests.scripts import recovery_job
from transpiler.layout.record import read_record_file

pytestmark = pytest.mark.processes

SEEDS = [int(s) for s in os.environ.get("PS_CHAOS_SEEDS", "1").split(",") if s.strip()]
EPOCHS = 60  # 1,200 steps of each trainer, 0.1 s each until the changes are made
# heartbeat_timeout as by default: a role SIGKILLed and started again takes up to ~20 s to start on a loaded
# 2-core machine, and one silent for longer is dropped and the step goes on without it (by design).
SLOW = ["--epochs", str(EPOCHS), "--step_delay", "0.1", "--heartbeat_timeout", "30"]
MODES = {"sync": [*recovery_job.FLOAT64, *SLOW], "async": ["--async", "--counting", *SLOW]}


class StandbyJob(ReplicatedJob):
    """A :class:`ReplicatedJob` that can grow to three shards: ``grown`` lists the three pservers, and
    ``backups`` their three backups; a role given n pservers is given the first n backups."""

    def __init__(self, tmp_path, etcd_url: str, args):
        super().__init__(tmp_path, etcd_url, n_pservers=2, args=args)
        third, backup = free_ports(2)
        self.grown = [*self.endpoints, f"127.0.0.1:{third}"]
        self.backups = [*self.backups, f"127.0.0.1:{backup}"]

    def env(self, role: str, index: int, endpoints=None) -> dict:
        env = super().env(role, index, endpoints)
        env["PS_REPLICA_ENDPOINTS"] = ",".join(self.backups[: len(endpoints or self.endpoints)])
        return env

    def address(self, name: str) -> str:
        k = int(name[-1])
        return self.grown[k] if name.startswith("pserver") else self.backups[k]

    def start_shard(self, index: int, endpoints=None) -> None:
        """Both processes of shard ``index``, given ``endpoints`` (default: the job's first list)."""
        self.start("PSERVER", index, endpoints=endpoints)
        self.start("REPLICA", index, endpoints=endpoints)


def ask(job: StandbyJob, pservers) -> subprocess.Popen:
    """``ps-reshard`` for ``pservers`` and as many of the job's backups, started."""
    command = [*reshard_command(job, pservers), "--replicas", ",".join(job.backups[: len(pservers)])]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def change_with_a_kill(job: StandbyJob, pservers, rng: random.Random) -> str:
    """Change the job to ``pservers`` while a seeded victim is SIGKILLed and started again; what was killed
    and what ``ps-reshard`` said. A change rolled back is asked again. Every shard is an in-sync pair
    first: hot standby survives the loss of one process of an in-sync shard (a primary lost while its
    backup still catches up is a shard restarting from its checkpoint, docs/recovery.md)."""
    for shard in range(len(read_record_file(job.ckpt).pservers)):
        job.wait_in_sync(shard)
    asking = ask(job, pservers)
    job.wait_until(lambda: read_record_file(job.ckpt).change is not None, "the change asked")
    growing = len(pservers) > len(job.endpoints) and "pserver2" not in job.procs
    if growing:
        job.start_shard(2, endpoints=job.grown)  # the new shard's two processes, once asked
    time.sleep(rng.uniform(0.0, 1.0))
    now = read_record_file(job.ckpt)
    shards = max(len(now.pservers), len(pservers))
    name = f"{rng.choice(['pserver', 'replica'])}{rng.randrange(shards)}"
    phase = now.change.phase if now.change is not None else f"committed (epoch {now.epoch})"
    job.kill(name)
    # Started again at once with the same command, as a supervisor does (one that left exits 0).
    index = int(name[-1])
    role = "REPLICA" if name.startswith("replica") else "PSERVER"
    job.start(role, index, endpoints=job.grown if index == 2 else None)
    out, _ = asking.communicate(timeout=150)
    said = f"{name} killed ({phase}); ps-reshard: {out.strip()}"
    if asking.returncode != 0:  # rolled back as one: asked again
        assert asking.returncode == 1, said + job.all_logs()
        again = ask(job, pservers)
        out, _ = again.communicate(timeout=150)
        assert again.returncode == 0, out + job.all_logs()
    return said


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", list(MODES))
def test_a_hot_standby_job_grows_and_shrinks_with_its_backups_through_a_sigkill(etcd, tmp_path, mode, seed):
    rng = random.Random(f"standby-{mode}-{seed}")
    print(f"chaos seed {seed}, mode {mode}")
    job = StandbyJob(tmp_path, etcd.url, MODES[mode])
    try:
        for k in range(2):
            job.start_shard(k)
        for tid in range(job.n_trainers):
            job.start("TRAINER", tid)
        for pservers in (job.grown, job.endpoints):
            trained_past(job, 5)
            print(change_with_a_kill(job, pservers, rng))
        (job.pause / "calm").touch()  # the rest of the job at full speed
        job.wait_trainers(180)
        codes = job.finish_pservers()
        assert set(codes.values()) == {0}, (codes, job.all_logs())
        record = read_record_file(job.ckpt)
        assert record.change is None and record.pservers == job.endpoints, record
        assert record.replicas == job.backups[:2], record
        if mode == "sync":
            job.assert_trained_as_one_process(epochs=EPOCHS)
            assert job.rollback_lines() == []
        else:
            steps = EPOCHS * recovery_job.SAMPLES // recovery_job.TRAINERS // recovery_job.BATCH
            # Each trainer finished all its steps, each acknowledged: trainer 0's pushes, TALLY x trainer 1's.
            assert_counted_once(job, -(steps + recovery_job.TALLY * steps))
    finally:
        job.close()
