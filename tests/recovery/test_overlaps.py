"""Overlapping failures that once ended a job, replayed deterministically with real processes.

1. Both trainers are down while one pserver restarts: it resumes from an older
   checkpoint than the other stands at, and no trainer is alive to roll the
   other back. The joining trainers do (once), and the job ends with the model
   of an uninterrupted run (sync); async pservers each go on from where they are.
2. A trainer whose push of step s one pserver applied while the other dropped
   it (for silence) and went on: its rejoin step (s + 1) and push step (s)
   differ. It goes on at s + 1 with every pserver instead of pushing a stale step.

(tests/scripts/recovery_job.py plays the roles; pauses and holds are file handshakes.)
"""

from __future__ import annotations

import signal

import pytest
import torch

from tests.helpers.jobs import assert_job_models_close
from tests.scripts import recovery_job
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

pytestmark = pytest.mark.processes

ROLES = ("trainer0", "trainer1", "pserver0", "pserver1")


def restart_pserver1_with_both_trainers_down(job, reached=("reached",)) -> None:
    """Trainer 0 paused before step 23 (checkpoints at 5..20): kill both trainers, restart pserver 1
    (it resumes from step 20, pserver 0 stays at 23), then start both trainers again. ``reached``:
    the pause files to wait for (async trainers each pause, else trainer 1 may finish before the kill
    and the pserver, with every trainer closed, stop before the restarted trainer 1 joins)."""
    for name in reached:
        job.wait_file(name)
    job.kill("trainer0")
    job.kill("trainer1")
    job.kill("pserver1")
    job.start("PSERVER", 1)
    job.wait_until(lambda: "serving" in job.log("pserver1.1"), "pserver 1 serving again")
    (job.pause / "go").touch()  # the restarted trainer 0 passes step 23 without pausing
    job.start("TRAINER", 0)
    job.start("TRAINER", 1)
    for name in ROLES:
        assert job.wait(name, 120) == 0, job.all_logs()


@pytest.mark.timeout(240)
def test_trainers_down_while_a_pserver_restarts_behind_the_other_roll_both_back_and_train_as_one_process(
    job_factory,
):
    job = job_factory(args=["--pause_at", "23", *recovery_job.FLOAT64])
    job.start_all()
    restart_pserver1_with_both_trainers_down(job)

    assert "resumes from the checkpoint at step 20" in job.log("pserver1.1")
    # One roll-back, though both joining trainers asked for it.
    assert job.log("pserver0.0").count("rolled back from step 23 to the checkpoint at step 20") == 1
    assert any("rolling every pserver back to it" in job.log(f"trainer{t}.1") for t in range(2))
    job.assert_trained_as_one_process()


@pytest.mark.timeout(240)
def test_async_trainers_down_while_a_pserver_restarts_from_an_older_checkpoint_go_on(job_factory):
    job = job_factory(
        args=["--async", "--optimizer", "sgd", "--lr", "0.1", "--pause_at", "23", "--pause_every_trainer"]
    )
    job.start_all()
    restart_pserver1_with_both_trainers_down(job, reached=("reached-0", "reached-1"))

    assert "resumes from" in job.log("pserver1.1")
    assert "rolled back" not in job.log("pserver0.0")  # async: each pserver goes on from where it is
    for t in range(2):  # each restarted trainer went on from its own step and trained all its data
        assert "finished at step 40" in job.log(f"trainer{t}.1"), job.log(f"trainer{t}.1")


def rows_on_second_pserver(job) -> dict:
    t = DistributeTranspiler(DistributeTranspilerConfig())
    program = recovery_job.build_program(dtype=torch.float64)
    t.transpile(0, program=program, pservers=",".join(job.endpoints), trainers=2)
    return recovery_job.rows_on(t.get_trainer_program(), job.endpoints[1])


@pytest.mark.timeout(240)
def test_a_trainer_whose_push_one_pserver_applied_and_the_other_dropped_goes_on_at_the_later_step(
    job_factory,
):
    s = 12
    job = job_factory(
        args=[
            "--hold_push",
            str(s),
            "--hold_trainer",
            "1",
            "--pause_at",
            str(s + 1),
            "--pause_trainer",
            "0",
            "--heartbeat_timeout",
            "3",
            *recovery_job.FLOAT64,
        ]
    )
    job.start_all()
    job.wait_file("held")  # pserver 0 applied step s with trainer 1's push; pserver 1 waits for it
    job.send_signal("trainer1", signal.SIGSTOP)
    job.wait_file("reached")  # pserver 1 dropped trainer 1 and applied s without it; trainer 0 at s + 1
    assert "trainer 1 sent nothing for" in job.log("pserver1.0")
    job.send_signal("trainer1", signal.SIGCONT)
    (job.pause / "release").touch()  # its push of s reaches pserver 1, which is at s + 1
    job.wait_until(lambda: f"rejoining at step {s + 1}" in job.log("trainer1.0"), "trainer 1 re-synced")
    (job.pause / "go").touch()
    for name in ROLES:
        assert job.wait(name, 120) == 0, job.all_logs()

    assert "pushed stale step" not in job.all_logs()
    # Step s: pserver 1's parameters got trainer 0's gradient alone; every other step both trainers'.
    expected = recovery_job.reference(epochs=2, alone=(s, rows_on_second_pserver(job)), dtype=torch.float64)
    assert_job_models_close(job.out, expected)
