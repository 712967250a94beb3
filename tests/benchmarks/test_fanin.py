"""The emulated fan-in (benchmarks/bench_fanin.py): its smoke run at K = 64, and its sync check's teeth.

The smoke run starts real processes (2 pservers, 2 load generators of 32 emulated trainers each),
sync and async, 2 steps: it must complete with no trainer dropped, the sync model must pass the check,
and every figure the benchmark reports must be there. No timing is asserted.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import sys

import numpy as np
import pytest
import torch

from benchmarks import bench_fanin
from benchmarks.common.paths import REPO
from benchmarks.jobs import fanin_job, fanin_workers
from benchmarks.jobs.fanin_job import GRID, TOLERANCE, Spec
from harness.paths import pythonpath_with_repo
from harness.processes import RunFailed, run_command
from tests.helpers.system import unavailable

POSITIVE = (
    "steps_per_s",
    "trainer_steps_per_s",
    "cpu_ms_per_push",
    "threads_idle",
    "threads_max",
    "rss_start_mb",
    "pushes_per_s",
    "push_p50_ms",
    "push_p99_ms",
    "push_window_s",
    "stats_window_s",
)
PRESENT = (
    "idle_kb_per_session",
    "step_holds_mb",
    "step_holds_kb_per_trainer",
    "prefetches_per_s",
    "heartbeats_per_s",
    "heartbeats_per_trainer_min",
)


@pytest.mark.processes
@pytest.mark.timeout(600)
def test_fanin_at_64_trainers_completes_with_no_trainer_dropped_and_the_sync_model_checked(tmp_path):
    out = tmp_path / "fanin.json"
    # Its own process, as CI would run it: its gRPC must not be running before it starts processes
    # (bench_fanin.main).
    run_command(
        [
            sys.executable,
            "-m",
            "benchmarks.bench_fanin",
            "--trainers",
            "64",
            "--modes",
            "sync,async",
            "--pservers",
            "2",
            "--load",
            "2",
            "--steps",
            "2",
            "--in_flight",
            "8",
            "--timeout",
            "400",
            "--json",
            str(out),
            "--work",
            str(tmp_path),
        ],
        str(tmp_path / "bench.log"),
        timeout=540,
        what="bench_fanin K=64",
        env={"PYTHONPATH": pythonpath_with_repo()},
        cwd=REPO,
    )
    runs = {r["mode"]: r for r in json.loads(out.read_text())["runs"]}
    assert sorted(runs) == ["async", "sync"]
    for mode, r in runs.items():
        assert (r["trainers"], r["pservers"], r["load_processes"], r["steps"], r["dropped"]) == (
            64,
            2,
            2,
            2,
            0,
        )
        assert r["in_flight"] == (8 if mode == "async" else 0)  # a sync step needs every push at once
        assert {key: r[key] for key in POSITIVE if not r[key] > 0} == {}, mode
        assert all(math.isfinite(r[key]) for key in PRESENT), mode
        assert min(r["heartbeats_per_s"], r["prefetches_per_s"]) >= 0
        assert r["threads_max"] >= r["threads_idle"]
    sync = runs["sync"]
    assert sync["release_p50_ms"] > 0 and sync["release_p99_ms"] >= sync["release_p50_ms"]
    check = sync["model_check"]
    assert check["rows_checked"] > 100
    assert max(check["dense_max_error"], check["rows_max_error"]) <= TOLERANCE
    assert runs["async"]["model_check"] is None


@pytest.mark.parametrize("sync_mode,in_flight,bound", [(False, 3, 3), (False, 0, None), (True, 3, None)])
def test_a_load_generators_trainers_in_a_step_at_once_are_bounded_in_async_runs_only(
    sync_mode, in_flight, bound
):
    window = fanin_workers.stepping(
        Spec(trainers=8, pservers=["127.0.0.1:1"], sync_mode=sync_mode, in_flight=in_flight)
    )
    if bound is None:
        assert isinstance(window, contextlib.nullcontext)  # every trainer steps at once
        return
    assert all(window.acquire(blocking=False) for _ in range(bound))
    assert not window.acquire(blocking=False)  # the next trainer waits for one to leave its step


def test_in_flight_is_refused_below_zero(capsys):
    with pytest.raises(SystemExit):
        bench_fanin.parse_args(["--in_flight", "-1"])
    assert "--in_flight must be >= 0" in capsys.readouterr().err
    assert bench_fanin.parse_args(["--in_flight", "16"]).in_flight == 16


def test_gradients_are_a_function_of_trainer_and_step_on_an_exact_grid():
    spec = Spec(trainers=4, pservers=["127.0.0.1:1"])
    ids = fanin_job.batch_ids(spec, 1, 2)
    assert np.array_equal(ids, fanin_job.batch_ids(spec, 1, 2))
    assert not np.array_equal(ids, fanin_job.batch_ids(spec, 2, 2))
    assert np.all(np.diff(ids) > 0) and np.all((ids >> fanin_job.SLOT_SHIFT) < fanin_job.JOB_S.S_SLOTS)
    rows = fanin_job.sparse_rows(spec, 1, 2, ids)
    assert rows.shape == (ids.size, 16)
    # A row depends on (trainer, step, id) only: the same for any subset of ids asked.
    assert torch.equal(fanin_job.sparse_rows(spec, 1, 2, ids[::7]), rows[::7])
    assert torch.equal(rows / GRID, (rows / GRID).round()) and rows.abs().max() <= 8 * GRID


def test_the_sync_check_fails_a_model_that_missed_one_trainers_gradients():
    spec = Spec(trainers=4, pservers=["127.0.0.1:1", "127.0.0.1:2"], steps=2)
    blocks = fanin_job.transpiler(spec).get_trainer_program().blocks
    ids = fanin_job.check_ids(spec)
    initial = {b.name: torch.randn(b.shape) * 0.05 for b in blocks}
    initial["@rows"] = torch.randn(ids.size, 16) * 0.01
    want, want_rows = fanin_job.expected_model(
        spec, blocks, {b.name: initial[b.name] for b in blocks}, ids, initial["@rows"]
    )
    final = {name: w.float() for name, w in want.items()}
    final["@rows"] = want_rows.float()
    assert bench_fanin.check_model(spec, {"initial": initial, "final": final})["rows_checked"] == ids.size
    # Trainer 3's step-1 gradient left out of the mean of the dense blocks: the check must see it.
    missing = fanin_job.dense_gradients(spec, blocks, 3, 1)
    wrong = {
        **final,
        **{name: final[name] + fanin_job.JOB_S.S_LR * g / spec.trainers for name, g in missing.items()},
    }
    with pytest.raises(RunFailed, match="sync model check failed"):
        bench_fanin.check_model(spec, {"initial": initial, "final": wrong})


@pytest.mark.processes
@pytest.mark.timeout(400)
@pytest.mark.parametrize("hot_standby", [False, True])
def test_fanin_with_a_pserver_killed_mid_run_recovers_every_trainer_and_the_sync_model(tmp_path, hot_standby):
    """--kill_pserver 1: pserver 1 is SIGKILLed once it counted half its pushes and started again; the
    16 emulated trainers re-sync through the trainer's own recovery (a roll-back to its checkpoint; with
    --replicas, the backup leads and nothing rolls back), the run completes with none dropped and the
    applied model passes the sync check."""
    if hot_standby and shutil.which("etcd") is None:
        unavailable("not installed: etcd (apt-get install etcd-server)")
    out = tmp_path / "fanin.json"
    run_command(
        [sys.executable, "-m", "benchmarks.bench_fanin", "--trainers", "16", "--modes", "sync"]
        + ["--load", "2", "--steps", "4", "--kill_pserver", "1", "--timeout", "300"]
        + (["--replicas"] if hot_standby else [])
        + ["--json", str(out), "--work", str(tmp_path)],
        str(tmp_path / "bench.log"),
        timeout=360,
        what="bench_fanin K=16 with a pserver killed",
        env={"PYTHONPATH": pythonpath_with_repo()},
        cwd=REPO,
    )
    (run,) = json.loads(out.read_text())["runs"]
    assert run["dropped"] == 0
    assert max(run["model_check"]["dense_max_error"], run["model_check"]["rows_max_error"]) <= TOLERANCE
    killed = run["pserver_killed"]
    assert killed["index"] == 1 and killed["killed_after_pushes"] >= 16 * 4 // 2
    assert killed["trainers_resynced"] == 16 and killed["recovery_s"] > 0
    assert ("backup_again_s" in killed) == hot_standby


@pytest.mark.parametrize(
    "case, pushes, expected",
    [
        (
            "each trainer's first push there sent after the kill; other pservers' ignored, and one sent "
            "before the kill though recorded after it",
            [
                (0, 1, 3, 5.5, 9.0),
                (0, 1, 4, 9.5, 10.0),
                (1, 1, 3, 8.0, 12.0),
                (1, 0, 3, 8.0, 13.0),
                (2, 1, 2, 4.0, 5.2),
            ],
            dict(trainers_resynced=2, recovery_s=7.0, resync_s=3.0, sessions_per_s=0.7),
        ),
        ("nobody had pushes left for it", [(0, 1, 1, 1.0, 2.0)], dict(trainers_resynced=0)),
    ],
)
def test_recovery_of_a_killed_pserver_from_the_trainers_push_records(case, pushes, expected):
    from benchmarks.common.fanin_faults import recovery_of

    fault = {"killed_at": 5.0, "up_at": 8.0}
    got = recovery_of(fault, np.array(pushes, dtype=np.float64), victim=1)
    assert {k: got[k] for k in expected} == expected, case
