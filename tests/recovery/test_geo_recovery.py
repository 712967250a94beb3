"""GEO mode's recovery guarantee, with real processes: a trainer killed between syncs loses exactly its
steps since its last sync, and its restart trains them again from that sync's data position."""

from __future__ import annotations

import pytest
import torch

from pserver.checkpoint.layout import find_saved, load_blocks
from tests.scripts import recovery_job

K = 4


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_geo_trainer_killed_between_syncs_loses_only_its_unsynced_steps(job_factory):
    """--counting: every local SGD step moves each element by -TALLY**t, a sync pushes the window's sum,
    and the pservers add it halved (2 trainers). Trainer 0 stands before its step 10 when killed: steps
    0-7 were synced (at 3 and 7), 8 and 9 were not. Its restart joins at step 8, trains 8-39 again, so
    each element ends at -(40 + TALLY * 40) / 2: no step lost for good, none counted twice."""
    steps = 2 * recovery_job.SAMPLES // recovery_job.TRAINERS // recovery_job.BATCH  # 40 per trainer
    job = job_factory(
        args=["--async", "--k_steps", str(K), "--counting", "--pause_at", "10", "--pause_trainer", "0"]
    )
    job.start_all()
    job.wait_file("reached")
    job.kill("trainer0")
    (job.pause / "go").touch()  # the restart passes its step 10 without pausing
    job.start("TRAINER", 0)
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 120) == 0, job.all_logs()
    assert "trainer 0: ready at step 8 (data position epoch 0 batch 8)" in job.log("trainer0.1")

    final = find_saved(job.ckpt, sync_mode=False)  # what each pserver saved once both trainers closed
    expected = -(steps + recovery_job.TALLY * steps) / 2
    for part in final.parts:
        for entries in load_blocks([part]).values():
            for block in entries:
                assert torch.equal(block["value"], torch.full_like(block["value"], expected)), block["param"]
    # One push per window: trainer 0's first process synced twice, its restart 8 times; trainer 1 10 times.
    assert [m["step"] for m in final.manifests] == [2 + 8 + 10] * 2
