"""ps-launch restarting a real job's roles (--max_restarts): the recovery job (tests/scripts/recovery_job.py)
with a pserver and a trainer SIGKILLed mid-run and started again by the launcher; the sync model must equal
an uninterrupted run's."""

from __future__ import annotations

from pathlib import Path
from typing import List

import pytest
import torch

from tests.helpers import paths
from tests.helpers.jobs import assert_job_models_close
from tests.helpers.launch import kill_role, prefixed, restarted
from tests.scripts import recovery_job

pytestmark = pytest.mark.processes

RECOVERY = str(paths.REPO / "tests" / "scripts" / "recovery_job.py")


EPOCHS = 10  # 200 steps of 2 trainers; the step delay (until PAUSE_DIR/calm) lets the kills land mid-run
STEP_DELAY = "0.05"


def checkpoint_steps(ckpt: Path) -> List[int]:
    """Steps of the complete checkpoints (both pservers' manifests written)."""
    if not ckpt.is_dir():
        return []
    return sorted(
        int(d.name.split("-")[1])
        for d in ckpt.glob("step-*")
        if len(list(d.glob("pserver-*-of-2.json"))) == 2
    )


@pytest.mark.timeout(300)
def test_max_restarts_survives_a_pserver_and_a_trainer_killed_mid_run(launcher, tmp_path):
    ckpt, out_dir, pause = tmp_path / "ckpt", tmp_path / "out", tmp_path / "pause"
    out_dir.mkdir()
    pause.mkdir()
    job = launcher(
        "--server_num",
        "2",
        "--worker_num",
        "2",
        "--max_restarts",
        "1",
        "--show",
        "trainers",
        RECOVERY,
        "--checkpoint_dir",
        str(ckpt),
        "--out_dir",
        str(out_dir),
        "--epochs",
        str(EPOCHS),
        "--step_delay",
        STEP_DELAY,
        "--checkpoint_every",
        "5",
        "--pause_dir",
        str(pause),
        *recovery_job.FLOAT64,
    )

    # Mid-run: the pservers have checkpointed step 10 together.
    job.wait_until(lambda: max(checkpoint_steps(ckpt), default=0) >= 10, "a checkpoint at step 10", 120)
    before = max(checkpoint_steps(ckpt))
    old = kill_role(job, "pserver.1")
    job.wait_until(lambda: restarted(job, "pserver.1", old), "pserver.1 to be restarted", 30)
    assert "ps-launch: pserver.1 was killed by SIGKILL; restart 1 of 1: started again as pid" in job.err()

    # Training goes on past where it was: the restarted pserver resumed and the trainers re-synced.
    job.wait_until(
        lambda: max(checkpoint_steps(ckpt), default=0) >= before + 10,
        f"training past step {before + 10} after the pserver's restart",
        120,
    )
    assert all(job.roles()[t]["returncode"] is None for t in ("trainer.0", "trainer.1")), job.story()
    old = kill_role(job, "trainer.1")
    job.wait_until(lambda: restarted(job, "trainer.1", old), "trainer.1 to be restarted", 30)
    assert "ps-launch: trainer.1 was killed by SIGKILL; restart 1 of 1: started again as pid" in job.err()
    (pause / "calm").touch()  # both kills are done: the trainers drop the step delay for the rest of the job

    assert job.finish(180) == 0, job.story()
    final = job.roles()
    assert {n: (r["restarts"], r["returncode"]) for n, r in final.items()} == {
        "pserver.0": (0, 0),
        "pserver.1": (1, 0),
        "trainer.0": (0, 0),
        "trainer.1": (1, 0),
    }
    # One log per role, the restart appended after a line that says why.
    server1 = job.log("serverlog.1")
    assert "===== ps-launch: pserver.1 was killed by SIGKILL; restart 1 of 1 =====" in server1
    assert "resumes from the checkpoint at step" in server1.split("=====")[-1]
    assert "===== ps-launch: trainer.1 was killed by SIGKILL; restart 1 of 1 =====" in job.log("workerlog.1")
    # The console showed both trainers' lines, and the restarted trainer's new ones.
    console = job.out()
    assert any("finished at step" in line for line in prefixed(console, "trainer0"))
    assert any("ps-launch: trainer.1 was killed by SIGKILL" in line for line in prefixed(console, "trainer1"))
    # Sync mode: the model of an uninterrupted run.
    expected = recovery_job.reference(epochs=EPOCHS, dtype=torch.float64)
    assert_job_models_close(out_dir, expected, detail=job.story)
