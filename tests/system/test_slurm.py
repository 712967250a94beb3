"""deploy/slurm's batch scripts run real jobs through a real Slurm cluster on this machine.

The cluster (:mod:`tests.helpers.slurm_cluster`): munged, slurmctld and two slurmd (nodes n1 and
n2) in a private network namespace. The jobs' roles come from Slurm's own variables
(``RoleEnv.from_env``'s Slurm source). Skipped, naming the command that failed, where Slurm is
not installed (``apt-get install slurm-wlm munge iproute2``) or does not start (not root, no
namespaces); failed instead under ``PS_REQUIRE_SYSTEM_TESTS=1``, as in CI (:mod:`tests.helpers.system`).

Select it with ``python -m pytest -q tests/system/test_slurm.py -rs``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import paths
from tests.helpers.jobs import assert_job_models_close
from tests.helpers.slurm_cluster import (
    NODES,
    ClusterUnavailable,
    finished,
    hosts_file,
    parse_jobs,
    slurm_conf,
    start_cluster,
)
from tests.helpers.system import unavailable
from tests.scripts import recovery_job

REPO = paths.REPO
TRAIN = REPO / "deploy" / "slurm" / "train.sbatch"
TRAIN_HET = REPO / "deploy" / "slurm" / "train-het.sbatch"
EXAMPLE = REPO / "examples" / "train_mlp.py"
RECOVERY_JOB = REPO / "tests" / "scripts" / "recovery_job.py"
JOB_TIMEOUT = 150.0  # one run of a job, imports on a busy 2-core machine included
ACCURACY_LINE = re.compile(r"^(\d+): .*trainer (\d+): test accuracy ([0-9.]+)", re.M)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """The module's two-node cluster; every daemon, job and the namespace are gone after the module."""
    reason = ""
    try:
        cluster = start_cluster(tmp_path_factory.mktemp("slurm"))
    except ClusterUnavailable as e:
        reason = f"no Slurm cluster: {e}"  # start_cluster already closed what it had started
    if reason:
        unavailable(reason)  # outside the except: the report shows the reason once, not chained to itself
    try:
        yield cluster
    finally:
        cluster.close()


def job_env(tmp_path: Path, **extra: str) -> dict:
    return {
        "PS_PYTHON": sys.executable,
        "PS_CHECKPOINT_ROOT": str(tmp_path / "checkpoints"),
        "PYTHONPATH": str(REPO),
        "PYTHONUNBUFFERED": "1",
        **extra,
    }


# -- the cluster's pure parts ------------------------------------------------------------------


def test_parse_jobs_reads_each_component():
    text = (
        "JobId=5 HetJobId=5 HetJobOffset=0 JobName=ps-train-het JobState=COMPLETED Reason=None "
        "Restarts=0 ExitCode=0:0 NodeList=n1\n"
        "JobId=6 HetJobId=5 HetJobOffset=1 JobName=ps-train-het JobState=RUNNING Reason=None "
        "Restarts=0 ExitCode=0:0 NodeList=n2\n"
    )
    jobs = parse_jobs(text)
    assert [(j["JobId"], j["JobState"], j["NodeList"]) for j in jobs] == [
        ("5", "COMPLETED", "n1"),
        ("6", "RUNNING", "n2"),
    ]
    assert not finished(jobs)
    assert finished([dict(jobs[0]), dict(jobs[1], JobState="FAILED")])
    assert not finished([])


@pytest.mark.parametrize("auth, expected", [("munge", "AuthType=auth/munge"), ("none", "AuthType=auth/none")])
def test_slurm_conf_names_both_nodes_and_the_auth(tmp_path, auth, expected):
    conf = slurm_conf(tmp_path, auth, tmp_path / "munge.socket")
    assert expected in conf.splitlines()
    assert ("AuthInfo=socket=" in conf) == (auth == "munge")
    for node, addr in NODES.items():
        assert re.search(rf"^NodeName={node} .*NodeAddr={addr} ", conf, re.M)
        assert f"{addr} {node}" in hosts_file().splitlines()


# -- real jobs ---------------------------------------------------------------------------------


@pytest.mark.processes
@pytest.mark.timeout(240, method="signal")  # SIGALRM: the cluster's teardown still runs
def test_heterogeneous_job_trains_mlp_to_its_accuracy(slurm, tmp_path):
    # Component 0: one pserver on n1; component 1: two trainers on n2.
    out = tmp_path / "job.out"
    job = slurm.submit(
        f"--chdir={tmp_path}",
        f"--output={out}",
        "-w",
        "n1",
        "-N1",
        "-n1",
        ":",
        "-w",
        "n2",
        "-N1",
        "-n2",
        str(TRAIN_HET),
        str(EXAMPLE),
        "--epochs",
        "8",
        env=job_env(tmp_path),
    )
    components = slurm.wait_job(job, JOB_TIMEOUT)
    log = out.read_text(errors="replace")
    assert [(c["JobState"], c["ExitCode"], c["NodeList"]) for c in components] == [
        ("COMPLETED", "0:0", "n1"),
        ("COMPLETED", "0:0", "n2"),
    ], log[-3000:]
    assert [c["Requeue"] for c in components] == ["1", "1"]  # the script's own --requeue (JobRequeue=0)
    assert "pserver n1:6170 serving" in log
    accuracies = {int(t): float(a) for _, t, a in ACCURACY_LINE.findall(log)}
    assert sorted(accuracies) == [0, 1], log[-3000:]
    assert all(a >= 0.95 for a in accuracies.values()), accuracies  # ~0.97 at 8 epochs, as at 12
    assert (tmp_path / "mlp_state_dict.pt").exists()  # trainer 0 saved the model
    assert sorted(p.name for p in (tmp_path / "checkpoints" / str(job)).glob("step-*"))


@pytest.mark.processes
@pytest.mark.timeout(300, method="signal")
def test_node_failure_requeues_the_job_which_resumes_from_its_checkpoint(slurm, tmp_path):
    # train.sbatch: one step of 4 tasks over both nodes, the first 2 pservers (n1), then 2 trainers
    # (n2). While trainer 0 waits before step 12, n2 goes DOWN: Slurm's node-failure path ends the
    # job on every node (the pservers on n1 checkpoint on its SIGTERM) and, by the script's own
    # --requeue (the cluster's JobRequeue=0), queues it again; run 1 resumes from the pservers'
    # checkpoint and ends with the model of an uninterrupted run.
    out, pause, models = tmp_path / "job.out", tmp_path / "pause", tmp_path / "models"
    pause.mkdir()
    models.mkdir()
    job = slurm.submit(
        f"--chdir={tmp_path}",
        f"--output={out}",
        "-N2",
        "--ntasks-per-node=2",
        str(TRAIN),
        str(RECOVERY_JOB),
        "--out_dir",
        str(models),
        "--pause_at",
        "12",
        "--pause_dir",
        str(pause),
        *recovery_job.FLOAT64,
        env=job_env(tmp_path, PS_PSERVER_NUM="2"),
    )
    slurm.wait_until(
        lambda: (pause / "reached").exists() or finished(slurm.job(job)),
        JOB_TIMEOUT,
        "trainer 0 to reach step 12",
    )
    assert (pause / "reached").exists(), out.read_text(errors="replace")[-3000:]
    r = slurm.run("scontrol", "update", "NodeName=n2", "State=DOWN", "Reason=test_node_failure")
    assert r.returncode == 0, r.stderr
    slurm.wait_until(lambda: slurm.job(job)[0].get("Restarts") == "1", 60, "the job to be requeued")
    # The node comes back (by ReturnToService=2 when its slurmd registers again, or by RESUME once
    # the killed job has left it), and run 1 starts.
    slurm.wait_until(
        lambda: (
            "down" not in slurm.node_state("n2")
            or slurm.run("scontrol", "update", "NodeName=n2", "State=RESUME").returncode == 0
        ),
        60,
        "n2 to come back",
    )
    (pause / "go").touch()  # run 1's trainer 0 passes step 12 without waiting
    (component,) = slurm.wait_job(job, JOB_TIMEOUT)
    log = out.read_text(errors="replace")
    assert (component["JobState"], component["ExitCode"], component["Restarts"]) == (
        "COMPLETED",
        "0:0",
        "1",
    ), log[-3000:]
    assert f"ps-train: job {job} run 0 on n[1-2]" in log and "DUE TO NODE FAILURE" in log
    assert f"ps-train: job {job} run 1 on n[1-2]" in log
    resumed = [
        int(s) for s in re.findall(r"pserver n1:617[01] resumes from the checkpoint at step (\d+)", log)
    ]
    assert len(resumed) == 2 and 0 < resumed[0] == resumed[1] <= 12, resumed
    assert_job_models_close(models, recovery_job.reference(epochs=2, dtype=torch.float64))


@pytest.mark.processes
@pytest.mark.timeout(120, method="signal")
def test_a_failed_step_requeues_the_job_at_most_ps_max_requeues_times(slurm, tmp_path):
    # A script that always fails: run 0 requeues the job itself, run 1 (SLURM_RESTART_COUNT=1) may not.
    script, out = tmp_path / "fail.py", tmp_path / "job.out"
    script.write_text(
        "import os, sys\nprint('run', os.environ.get('SLURM_RESTART_COUNT', '0'))\nsys.exit(3)\n"
    )
    job = slurm.submit(
        f"--chdir={tmp_path}",
        f"--output={out}",
        "-N1",
        "-n1",
        str(TRAIN),
        str(script),
        env=job_env(tmp_path, PS_MAX_REQUEUES="1", PS_CHECKPOINT_FLAG=""),
    )
    (component,) = slurm.wait_job(job, 60)
    log = out.read_text(errors="replace")
    assert (component["JobState"], component["ExitCode"], component["Restarts"]) == ("FAILED", "3:0", "1"), (
        log
    )
    assert log.count("requeueing (run 1 of at most 2)") == 1, log
    assert "0: run 0" in log and "0: run 1" in log, log
