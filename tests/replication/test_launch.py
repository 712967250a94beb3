"""Hot standby through ps-launch and the operators' views: the plan of a replicated job, ps-stat's
replica table, and a whole replicated job started the way a user starts it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import grpc
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from pserver.ops import stat_cli
from psproto import ps_pb2, ps_pb2_grpc
from tests.helpers import paths
from tests.helpers.etcd import etcd_fixture  # noqa: F401
from tests.helpers.jobs import assert_job_models_close
from tests.helpers.polling import poll
from tests.scripts import recovery_job
from trainer.launch import plan as launch_plan
from trainer.launch.plan import PSERVER, LaunchError
from trainer.launch.role import child_env
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, RoleEnv
from transpiler.roles.replicas import resolve_replicas

REPO = paths.REPO
PROBE = str(REPO / "tests" / "scripts" / "role_probe.py")
URL = "http://127.0.0.1:2379"


def args_for(*argv: str):
    return launch_plan.parse_args([*argv, PROBE])


@pytest.mark.timeout(10)
def test_local_plan_starts_a_second_process_per_pserver_and_every_role_knows_the_pairs():
    roles = launch_plan.plan_roles(
        args_for("--server_num", "2", "--server_replicas", "2", "--coordinator", URL, "--worker_num", "2"),
        environ={},
    )
    servers = [r for r in roles if r.kind == PSERVER]
    assert [(r.index, r.replica, r.tag, r.log_name) for r in servers] == [
        (0, 0, "pserver0", "serverlog.0"),
        (1, 0, "pserver1", "serverlog.1"),
        (0, 1, "pserver0.replica", "serverlog.0.replica"),
        (1, 1, "pserver1.replica", "serverlog.1.replica"),
    ]
    assert len({r.unit for r in servers}) == 4  # each process restarts on its own
    primaries, backups = [r.endpoint for r in servers[:2]], [r.endpoint for r in servers[2:]]
    prefixes = set()
    for r in roles:
        env = child_env(r, base={})
        assert env["PS_SERVER_REPLICAS"] == "2" and env["PS_COORDINATOR"] == URL
        assert env["PS_REPLICA_ENDPOINTS"] == ",".join(backups)
        assert env["PADDLE_PSERVERS_IP_PORT_LIST"] == ",".join(primaries)
        prefixes.add(env["PS_COORDINATOR_PREFIX"])
        role = RoleEnv.from_env(env)
        config = resolve_replicas(DistributeTranspilerConfig(), role.pservers, env)
        assert (config.server_replicas, config.coordinator) == (2, URL)
        if r.kind == PSERVER:
            assert role.current_endpoint == r.endpoint
    assert len(prefixes) == 1 and prefixes.pop().startswith("/torch-pserver/launch-")


@pytest.mark.timeout(10)
def test_per_host_plan_takes_the_second_processes_from_replica_servers():
    args = args_for(
        "--servers",
        "10.0.0.1:6170,10.0.0.2:6170",
        "--replica_servers",
        "10.0.0.2:6171,10.0.0.1:6171",
        "--server_replicas",
        "2",
        "--coordinator",
        URL,
        "--workers",
        "10.0.0.1,10.0.0.2",
    )
    roles = launch_plan.plan_roles(args, is_local=lambda h: h == "10.0.0.1", environ={})
    assert [(r.kind, r.index, r.replica, r.endpoint) for r in roles] == [
        (PSERVER, 0, 0, "10.0.0.1:6170"),
        (PSERVER, 1, 1, "10.0.0.1:6171"),
        ("TRAINER", 0, 0, None),
    ]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--server_num", "2", "--server_replicas", "3", "--coordinator", URL, "--worker_num", "1"],
            "must be 1 or 2",
        ),
        (["--server_num", "2", "--server_replicas", "2", "--worker_num", "1"], "needs --coordinator"),
        (["--server_num", "2", "--coordinator", URL, "--worker_num", "1"], "need --server_replicas 2"),
        (
            [
                "--servers",
                "10.0.0.1:6170",
                "--server_replicas",
                "2",
                "--coordinator",
                URL,
                "--workers",
                "10.0.0.1",
            ],
            "needs --replica_servers",
        ),
        (
            [
                "--servers",
                "10.0.0.1:6170",
                "--replica_servers",
                "10.0.0.2:1,10.0.0.3:1",
                "--server_replicas",
                "2",
                "--coordinator",
                URL,
                "--workers",
                "10.0.0.1",
            ],
            "lists 2 endpoints for 1",
        ),
        (["--worker_num", "2", "--server_replicas", "2", "--coordinator", URL], "collective job has none"),
    ],
)
def test_replica_flags_are_checked(argv, message):
    with pytest.raises(LaunchError, match=message):
        launch_plan.plan_roles(args_for(*argv), environ={})


def test_ps_stat_prints_a_replica_row_per_process_and_json_numbers():
    reply = ps_pb2.StatsReply(
        endpoint="a",
        replica=ps_pb2.ReplicaStats(
            role="primary", epoch=12, primary="a", backup="b", backup_in_sync=True, lag=1, replicated=3456
        ),
    )
    assert stat_cli.replica_row("a", reply) == [("a", "primary", "12", "a", "b", "yes", "1", "3,456", "0")]
    assert stat_cli.replica_row("a", ps_pb2.StatsReply(endpoint="a")) == []  # no replicas: no row
    as_json = stat_cli.as_json("a", reply, None)
    assert as_json["replica"]["epoch"] == 12 and as_json["replica"]["replicated"] == 3456
    assert "replica" not in stat_cli.as_json("a", ps_pb2.StatsReply(endpoint="a"), None)


def test_a_backups_plan_serves_its_pservers_shard():
    config = DistributeTranspilerConfig(
        server_replicas=2, replica_endpoints="127.0.0.1:3,127.0.0.1:4", coordinator=URL
    )
    from harness.models import odd_program

    t = DistributeTranspiler(config)
    t.transpile(0, program=odd_program(), pservers="127.0.0.1:1,127.0.0.1:2", trainers=2)
    for primary, backup in (("127.0.0.1:1", "127.0.0.1:3"), ("127.0.0.1:2", "127.0.0.1:4")):
        a, b = t.get_pserver_program(primary), t.get_pserver_program(backup)
        assert (a.shard, a.blocks, a.layout_digest) == (b.shard, b.blocks, b.layout_digest)
    with pytest.raises(ValueError, match="nor in|not one of the pservers"):
        t.get_pserver_program("127.0.0.1:9")


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_ps_launch_runs_a_replicated_job_and_ps_stat_shows_the_pairs(etcd, tmp_path):
    """ps-launch --server_replicas 2: every shard gets an in-sync backup, the job trains and ends 0, and each
    trainer's model equals single-process training."""
    log_dir, pause = tmp_path / "log", tmp_path / "pause"
    pause.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
    env["PS_TENSORBOARD_EVERY"] = "2"  # trainer 0 writes each shard's replication lag (docs/tensorboard.md)
    # The trainers wait before their first step until every shard's backup is in sync: a backup still
    # starting (a loaded machine) would otherwise find a job that already ended.
    cmd = [
        sys.executable,
        "-m",
        "trainer.launch",
        "--server_num",
        "2",
        "--server_replicas",
        "2",
        "--coordinator",
        etcd.url,
        "--worker_num",
        "2",
        "--log_dir",
        str(log_dir),
        "--show",
        "none",
        "--tensorboard_dir",
        str(tmp_path / "tb"),
        str(REPO / "tests" / "scripts" / "recovery_job.py"),
        "--checkpoint_dir",
        str(tmp_path / "ckpt"),
        "--out_dir",
        str(tmp_path),
        "--pause_at",
        "0",
        "--pause_every_trainer",
        "--pause_dir",
        str(pause),
        *recovery_job.FLOAT64,
    ]
    launcher = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        poll(
            lambda: all((pause / f"reached-{t}").exists() for t in (0, 1)), "both trainers before step 0", 120
        )
        endpoints = [
            r["endpoint"]
            for r in json.loads((log_dir / "roles.json").read_text())["roles"]
            if r["kind"] == "PSERVER"
        ]
        poll(
            lambda: primaries_in_sync(endpoints) == 2, "a primary with its backup in sync for each shard", 120
        )
        (pause / "go").touch()
        stdout, stderr = launcher.communicate(timeout=180)
    finally:
        if launcher.poll() is None:
            launcher.terminate()  # ps-launch stops every role it started
            launcher.communicate(timeout=30)
    logs = {p.name: p.read_text(errors="replace") for p in log_dir.glob("*log*")}
    assert launcher.returncode == 0, (stdout[-2000:], stderr[-2000:], {k: v[-1500:] for k, v in logs.items()})
    servers = {k: v for k, v in logs.items() if k.startswith("serverlog")}
    assert sorted(servers) == ["serverlog.0", "serverlog.0.replica", "serverlog.1", "serverlog.1.replica"]
    for shard in (0, 1):
        pair = servers[f"serverlog.{shard}"] + servers[f"serverlog.{shard}.replica"]
        assert "leads shard" in pair and "is in sync at message" in pair, pair[-3000:]
    assert_job_models_close(tmp_path, recovery_job.reference(epochs=2, dtype=torch.float64))
    board = EventAccumulator(str(tmp_path / "tb" / "trainer-0"))
    board.Reload()
    for shard in (0, 1):  # what the primary's backup had not acknowledged when asked: a few messages at most
        lag = [e.value for e in board.Scalars(f"pserver{shard}/replication_lag")]
        assert lag and all(0 <= v <= 8 for v in lag), lag
    roles = json.loads((log_dir / "roles.json").read_text())["roles"]
    assert sum(r["kind"] == "PSERVER" for r in roles) == 4 and all(
        r["endpoint"] for r in roles if r["kind"] == "PSERVER"
    )


def primaries_in_sync(endpoints) -> int:
    """How many of the processes at ``endpoints`` lead their shard with the backup in sync (Stats)."""
    found = 0
    for endpoint in endpoints:
        with grpc.insecure_channel(endpoint) as channel:
            try:
                stats = ps_pb2_grpc.ParameterServerStub(channel).Stats(ps_pb2.StatsRequest(), timeout=2)
            except grpc.RpcError:
                continue
        found += stats.replica.role == "primary" and stats.replica.backup_in_sync
    return found
