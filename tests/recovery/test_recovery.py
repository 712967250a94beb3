"""Faults in real processes: a pserver SIGKILLed mid-run and started again, a trainer SIGKILLed.

Each role is its own process (tests/scripts/recovery_job.py) on loopback; the
job pauses one trainer at a known step (a file handshake) so the test kills a
role at a known point. The sync results are compared with single-process PyTorch.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest
import torch

from harness.cluster import LocalCluster
from harness.models import assert_state_close
from pserver.checkpoint.layout import find_saved, load_blocks
from tests.helpers import checkpoint_models as cm
from tests.scripts import recovery_job
from trainer.errors import PserverError
from trainer.transport import Channels


class Background:
    """``target(*args)`` in a thread; :meth:`finish` fails the test if it raised or has not returned,
    where a plain thread would only print its exception and let the test pass."""

    def __init__(self, target, *args):
        self.error = None
        self.thread = threading.Thread(target=self._run, args=(target, args), daemon=True)
        self.thread.start()

    def _run(self, target, args) -> None:
        try:
            target(*args)
        except BaseException as e:
            self.error = e

    def finish(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"still running after {timeout} s"
        if self.error is not None:
            raise self.error


def wait_until(ready, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.01)


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_pserver_killed_mid_run_and_restarted_resumes_from_checkpoint(job_factory):
    job = job_factory(args=["--pause_at", "23", *recovery_job.FLOAT64])
    job.start_all()
    job.wait_file("reached")  # trainer 0 is about to train step 23; checkpoints at 5..20 exist
    job.kill("pserver1")
    job.start("PSERVER", 1)  # the same command
    (job.pause / "go").touch()
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 120) == 0, job.all_logs()

    restarted = job.log("pserver1.1")
    assert "resumes from the checkpoint at step 20" in restarted, restarted
    assert "rolled back from step" in job.log("pserver0.0")
    assert "restarted (from the checkpoint at step 20)" in job.log("trainer0.0")
    # The steps after the checkpoint were redone on the same data: the same model as never failing.
    job.assert_trained_as_one_process()


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_trainer_killed_in_sync_mode_is_dropped_and_may_rejoin(job_factory):
    heartbeat_timeout = 3.0
    job = job_factory(
        args=["--pause_at", "12", "--pause_trainer", "1", "--heartbeat_timeout", str(heartbeat_timeout)]
    )
    job.start_all()
    job.wait_file("reached")
    job.kill("trainer1")
    started = time.monotonic()
    assert job.wait("trainer0", 60) == 0, job.all_logs()
    # Trainer 0 waited about one heartbeat_timeout at the barrier, not the barrier_timeout: it finished
    # (its remaining 28 steps alone included) well before halfway between the two.
    assert time.monotonic() - started < (heartbeat_timeout + recovery_job.BARRIER_TIMEOUT) / 2
    for i in range(2):
        assert "trainer 1 sent nothing for" in job.log(f"pserver{i}.0")
        assert "dropped from the barrier at step 12" in job.log(f"pserver{i}.0")

    # A restarted trainer 1 rejoins, starts from the current parameters, and finishes its data.
    final0 = torch.load(job.out / "trainer-0.pt")
    job.start("TRAINER", 1)
    assert job.wait("trainer1", 60) == 0, job.all_logs()
    assert_state_close(torch.load(job.out / "start-1.pt"), final0, atol=0)
    for i in range(2):
        assert job.wait(f"pserver{i}", 30) == 0, job.all_logs()
        assert "trainer 1 rejoined" in job.log(f"pserver{i}.0")


def tallies(part: str) -> set:
    """The pushes of each trainer a --counting job's checkpoint part holds, per block:
    {(trainer 0's, trainer 1's)}, one pair when every block received the same pushes."""
    counts = set()
    for entries in load_blocks([part]).values():
        for block in entries:
            value = -block["value"]
            n = int(value.flatten()[0])
            assert torch.equal(value, torch.full_like(value, n)), block["param"]  # every element alike
            counts.add((n % recovery_job.TALLY, n // recovery_job.TALLY))
    return counts


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_async_pserver_killed_and_restarted_loses_exactly_its_updates_since_its_checkpoint(job_factory):
    """Each trainer's pushes are counted in the parameters (recovery_job --counting): pserver 1, killed
    between checkpoints, comes back with its checkpoint's counts and then applies every push that
    follows, so it lacks exactly the pushes it applied after that checkpoint; pserver 0 has all."""
    pause_at, every, steps = 14, 5, 2 * recovery_job.SAMPLES // recovery_job.TRAINERS // recovery_job.BATCH
    job = job_factory(
        args=[
            "--async",
            "--counting",
            "--pause_every_trainer",
            "--pause_at",
            str(pause_at),
            "--checkpoint_every",
            str(every),
        ]
    )
    job.start_all()
    for t in range(2):
        job.wait_file(f"reached-{t}")
    # Both trainers stand before their step 14 and each of their steps waited for its pushes: both
    # pservers applied 2 * 14 = 28 and wrote their latest checkpoint at 25.
    job.kill("pserver1")
    checkpoint = find_saved(job.ckpt, sync_mode=False, shard=1)
    assert checkpoint.step == every * (2 * pause_at // every) < 2 * pause_at
    (held,) = tallies(checkpoint.parts[1])
    assert sum(held) == checkpoint.step
    assert {t: v["last_step"] for t, v in checkpoint.manifests[1]["trainers"].items()} == {
        "0": held[0] - 1,
        "1": held[1] - 1,
    }
    job.start("PSERVER", 1)
    (job.pause / "go").touch()
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 120) == 0, job.all_logs()
    assert f"resumes from the checkpoint at step {checkpoint.step}" in job.log("pserver1.1")
    assert "rolled back" not in job.log("pserver0.0")

    # What each pserver saved once every trainer had closed.
    final = find_saved(job.ckpt, sync_mode=False)
    assert tallies(final.parts[0]) == {(steps, steps)} and final.manifests[0]["step"] == 2 * steps
    after = steps - pause_at  # each trainer's pushes from its step 14 on, all after the restart
    assert tallies(final.parts[1]) == {(held[0] + after, held[1] + after)}
    lost = 2 * steps - final.manifests[1]["step"]
    assert lost == 2 * pause_at - checkpoint.step > 0


def lose_pserver_1_during_the_next_join(cluster: LocalCluster, monkeypatch) -> list:
    """Pserver 1 stops right after answering the next Hello, and is started again (from its
    checkpoint) at the Hello after that, once the trainer's first pull has failed; returns the
    list of Hello timeouts, one per Hello round."""
    hellos = []
    real_hello = Channels.hello

    def hello(channels, timeout, join_at=0):
        hellos.append(timeout)
        if len(hellos) == 2:
            cluster.restart_pserver(1)
        replies = real_hello(channels, timeout, join_at)
        if len(hellos) == 1:
            cluster.servers[1].stop()
        return replies

    monkeypatch.setattr(Channels, "hello", hello)
    return hellos


@pytest.mark.timeout(60)
def test_trainer_starting_while_a_pserver_restarts_waits_for_it_and_joins(tmp_path, monkeypatch, caplog):
    """A pserver lost between a new trainer's Hello and its first pull is waited for, not fatal."""
    config = cm.config(str(tmp_path / "ckpt"))
    with LocalCluster(cm.program, 2, 2, sync_mode=False, config=config) as cluster:
        with cluster.trainer(0) as tr0:
            cm.train(tr0, cm.batches(3))
            tr0.checkpoint()
            trained = cm.snapshot(tr0)
            hellos = lose_pserver_1_during_the_next_join(cluster, monkeypatch)
            with cluster.trainer(1) as tr1:
                monkeypatch.undo()
                assert len(hellos) == 2
                assert_state_close(cm.snapshot(tr1), trained, atol=0)
    assert "trainer 1: joining failed (pserver %s" % cluster.endpoints[1] in caplog.text


def train_past_a_checkpoint(tr) -> dict:
    """Train 3 steps, checkpoint, train 2 more; the model at the checkpoint (step 3)."""
    cm.train(tr, cm.batches(3))
    tr.checkpoint()
    at_checkpoint = cm.snapshot(tr)
    cm.train(tr, cm.batches(2))
    return at_checkpoint


@pytest.mark.timeout(60)
def test_sole_sync_trainer_joining_while_a_pserver_restarts_rolls_the_other_back(
    tmp_path, monkeypatch, caplog
):
    """No other trainer is alive to roll pserver 0 back to the restarted one's checkpoint: the joining one
    does."""
    config = cm.config(str(tmp_path / "ckpt"))
    with LocalCluster(cm.program, 2, 1, config=config) as cluster:
        with cluster.trainer(0) as tr:
            at_checkpoint = train_past_a_checkpoint(tr)
        lose_pserver_1_during_the_next_join(cluster, monkeypatch)
        with cluster.trainer(0) as tr:
            monkeypatch.undo()
            assert tr.step_count == 3
            assert [s.engine.step for s in cluster.servers] == [3, 3]
            assert_state_close(cm.snapshot(tr), at_checkpoint, atol=0)
    assert "rolled back from step 5" in caplog.text


@pytest.mark.timeout(60)
def test_a_pull_heals_like_a_step_and_a_sync_pull_rolls_back_with_the_restarted_pserver(tmp_path, caplog):
    """tr.pull() (and so state_dict) with a pserver restarted since the last step: waited for and
    re-synced."""
    config = cm.config(str(tmp_path / "ckpt"))
    with LocalCluster(cm.program, 2, 1, config=config) as cluster:
        with cluster.trainer(0) as tr:
            at_checkpoint = train_past_a_checkpoint(tr)
            cluster.servers[1].stop()
            cluster.restart_pserver(1)  # back at the checkpoint of step 3
            tr.pull()
            assert tr.step_count == 3 and tr.position == (0, 3)
            assert [s.engine.step for s in cluster.servers] == [3, 3]
            assert_state_close(cm.snapshot(tr), at_checkpoint, atol=0)
    assert "rolled back from step 5" in caplog.text and "pull at step 5 failed" in caplog.text


@pytest.mark.timeout(60)
def test_async_pserver_restarted_after_a_trainer_closed_does_not_wait_for_it(tmp_path):
    """Trainer 1 closed after the last checkpoint: the restarted pserver knows, and finishes with trainer
    0."""
    with LocalCluster(cm.program, 2, 2, sync_mode=False, config=cm.config(str(tmp_path / "ckpt"))) as cluster:
        with cluster.trainer(0) as tr0:
            cm.train(tr0, cm.batches(2))
            tr0.checkpoint()
            with cluster.trainer(1) as tr1:
                cm.train(tr1, cm.batches(2))
            cluster.servers[1].stop()
            restarted = cluster.restart_pserver(1)
            assert restarted.engine.roster.closed == {1}
            cm.train(tr0, cm.batches(2))
        assert restarted.wait(10)  # every trainer closed: it would serve on, waiting for trainer 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("restart", ["before_close", "while_closing"])
def test_close_lost_to_a_stopped_pserver_is_sent_again_to_its_restart(tmp_path, caplog, restart):
    """Trainer 1 closes while pserver 1 is down (restarted first, or while its Close waits): the Close
    reaches the restarted pserver, which would otherwise wait for trainer 1 and never finish."""
    caplog.set_level(logging.INFO, logger="trainer.transport")
    config = cm.config(str(tmp_path / "ckpt"), connect_timeout=30.0)
    with LocalCluster(cm.program, 2, 2, sync_mode=False, config=config) as cluster:
        with cluster.trainer(0) as tr0:
            cm.train(tr0, cm.batches(2))
            tr1 = cluster.trainer(1)
            cm.train(tr1, cm.batches(2))
            tr0.checkpoint()  # trainer 1 has not closed in it
            cluster.servers[1].stop()
            if restart == "before_close":  # the restarted pserver does not know trainer 1's session
                restarted = cluster.restart_pserver(1)
                tr1.close()
            else:  # the Close waits for pserver 1 to come back
                closing = Background(tr1.close)
                wait_until(
                    lambda: "sending it again" in caplog.text, "trainer 1's Close to wait for pserver 1"
                )
                restarted = cluster.restart_pserver(1)
                closing.finish(30)
            assert restarted.engine.roster.closed == {1}
            assert [s.engine.roster.closed for s in cluster.servers] == [{1}, {1}]
            cm.train(tr0, cm.batches(2))
        assert restarted.wait(10)  # every trainer closed


@pytest.mark.timeout(60)
def test_sync_trainer_closed_after_the_checkpoint_is_not_waited_for_after_a_roll_back(tmp_path):
    """Rolled back to a checkpoint older than trainer 1's close, trainer 0 redoes the steps alone."""
    data = cm.batches(5)
    config = cm.config(str(tmp_path / "ckpt"), checkpoint_every=3)
    with LocalCluster(cm.program, 2, 2, config=config) as cluster:
        with cluster.trainer(0) as tr0:
            with cluster.trainer(1) as tr1:
                one = Background(cm.train, tr1, data)
                cm.train(tr0, data)
                one.finish(30)
            assert [s.engine.step for s in cluster.servers] == [5, 5]
            cluster.servers[1].stop()
            cluster.restart_pserver(1)  # back at the checkpoint of step 3
            cm.train(tr0, data[3:4])  # fails, rolls pserver 0 back to 3 too
            assert tr0.step_count == 3
            started = time.monotonic()
            cm.train(tr0, data[3:])
            # Waiting for trainer 1 would take a barrier_timeout, or a heartbeat_timeout until it is
            # dropped; two steps alone take a fraction of either.
            assert tr0.step_count == 5
            assert time.monotonic() - started < min(config.barrier_timeout, config.heartbeat_timeout) / 2
            assert [s.engine.roster.closed for s in cluster.servers] == [{1}, {1}]


@pytest.mark.timeout(60)
def test_trainer_joining_sync_pservers_apart_rolls_them_back_to_the_checkpoint_one_restarted_from(tmp_path):
    """No trainer was alive to roll pserver 0 back when pserver 1 restarted: the joining trainer does."""
    config = cm.config(str(tmp_path / "ckpt"))
    with LocalCluster(cm.program, 2, 1, config=config) as cluster:
        with cluster.trainer(0) as tr:
            cm.train(tr, cm.batches(3))
            tr.checkpoint()
            at_checkpoint = tr.state_dict()
            cm.train(tr, cm.batches(2))
        cluster.servers[1].stop()
        cluster.restart_pserver(1)
        assert [s.engine.step for s in cluster.servers] == [5, 3]
        with cluster.trainer(0) as tr:
            assert tr.step_count == 3 and [s.engine.step for s in cluster.servers] == [3, 3]
            assert_state_close(tr.state_dict(), at_checkpoint, atol=0)


@pytest.mark.timeout(60)
def test_trainer_joining_sync_pservers_apart_without_a_checkpoint_fails_after_recovery_timeout_naming_it(
    tmp_path,
):
    """Pserver 1 restarted with no checkpoint_dir: nothing to roll pserver 0 back to; the join gives up."""
    # The failed join leaves trainer 0's session open on pserver 1, so a later join would wait one
    # alive window (3 heartbeat intervals) to take the id over: 1.5 s here, not the default 6 s.
    config = cm.config(None, recovery_timeout=1.0, heartbeat_interval=0.5)
    with LocalCluster(cm.program, 2, 1, config=config) as cluster:
        with cluster.trainer(0) as tr:
            cm.train(tr, cm.batches(3))
        cluster.servers[1].stop()
        cluster.restart_pserver(1)
        assert [s.engine.step for s in cluster.servers] == [3, 0]
        with pytest.raises(
            PserverError,
            match="stand at step 0 without a checkpoint at that step to roll "
            r"the others back to \(no checkpoint_dir",
        ):
            cluster.trainer(0)


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_sigterm_checkpoints_every_pserver_and_the_same_command_resumes_the_job(job_factory):
    job = job_factory(args=["--pause_at", "23", *recovery_job.FLOAT64])
    job.start_all()
    job.wait_file("reached")  # both pservers at step 23 (checkpoints every 5: the last is 20)
    for i in range(2):
        os.killpg(job.procs[f"pserver{i}"].pid, signal.SIGTERM)
    for i in range(2):
        assert job.wait(f"pserver{i}", 30) == 0, job.all_logs()
    assert find_saved(job.ckpt, sync_mode=True).step == 23  # written on SIGTERM, by both
    for i in range(2):
        job.start("PSERVER", i)  # the same command: resumes at step 23
    (job.pause / "go").touch()
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 120) == 0, job.all_logs()
    assert "resumes from the checkpoint at step 23" in job.log("pserver0.1")
    job.assert_trained_as_one_process()
