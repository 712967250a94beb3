"""ps-launch with trainer nodes of several processes, and collective jobs: real processes on loopback."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers import paths
from tests.helpers.launch import assert_all_gone, finish, records
from transpiler import RoleEnv

pytestmark = pytest.mark.processes

REPO = paths.REPO
PROBE = str(REPO / "tests" / "scripts" / "node_probe.py")
# What a launcher run under torchrun, on a GPU host, inside another job would pass on.
OUTER = {
    "LOCAL_RANK": "5",
    "LOCAL_WORLD_SIZE": "8",
    "MASTER_ADDR": "10.9.9.9",
    "MASTER_PORT": "1",
    "RANK": "13",
    "WORLD_SIZE": "16",
    "PADDLE_TRAINER_ID": "99",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
}


def parsed(rec: dict) -> RoleEnv:
    return RoleEnv.from_env({k: v for k, v in rec["env"].items() if v is not None})


def table_row(out: str, rec: dict) -> str:
    (row,) = [line for line in out.splitlines() if str(rec["pid"]) in line.split()]
    return row


@pytest.mark.timeout(60)
def test_pserver_job_with_two_processes_per_node(run_launcher, tmp_path, probe_dir):
    proc = run_launcher(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--nproc_per_node",
        "2",
        "--gpus",
        "0,1,2,3",
        "--log_dir",
        "logs",
        PROBE,
        "--nproc",
        "2",
        env=OUTER,
    )
    rc, out, err = finish(proc, 45)
    assert rc == 0, err
    recs = records(probe_dir)
    assert sorted(recs) == ["pserver.0", "trainer.0.0", "trainer.0.1", "trainer.1.0", "trainer.1.1"]
    server = recs.pop("pserver.0")
    endpoint = server["env"]["PADDLE_PSERVERS_IP_PORT_LIST"]
    assert server["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert parsed(server).current_endpoint == endpoint
    assert all(server["env"][k] is None for k in ("LOCAL_RANK", "MASTER_PORT", "RANK", "PADDLE_TRAINER_ID"))
    ports = {}
    for name, rec in recs.items():
        node, local_rank = map(int, name.split(".")[1:])
        env = parsed(rec)
        assert (env.role, env.pservers, env.trainers, env.trainer_id) == ("TRAINER", [endpoint], 2, node)
        assert not env.collective
        assert (env.local_rank, env.local_world_size, env.rank, env.world_size) == (
            local_rank,
            2,
            local_rank,
            2,
        )
        assert env.node.master_addr == "127.0.0.1"
        ports.setdefault(node, set()).add(env.node.master_port)
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == ("0,1" if node == 0 else "2,3")
        log = tmp_path / "logs" / (f"workerlog.{node}" + (f".{local_rank}" if local_rank else ""))
        assert f"{name} started (pid {rec['pid']})" in log.read_text()
        row = table_row(out, rec)
        assert row.split()[:2] == ["TRAINER", str(node)]
        assert f"trainer node {node} local rank {local_rank}/2 on 127.0.0.1" in row
        assert str(log.relative_to(tmp_path)) in row
    # One rendezvous per node, each its own, none a pserver's.
    assert all(len(p) == 1 for p in ports.values()) and len(ports[0] | ports[1]) == 2
    assert not {f"127.0.0.1:{p}" for p in ports[0] | ports[1]} & {endpoint}
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "roles.json",
        "serverlog.0",
        "workerlog.0",
        "workerlog.0.1",
        "workerlog.1",
        "workerlog.1.1",
    ]
    assert "all roles finished" in out
    assert_all_gone(records(probe_dir))


@pytest.mark.timeout(60)
def test_collective_job_has_one_group_and_no_pservers(run_launcher, tmp_path, probe_dir):
    proc = run_launcher(
        "--worker_num", "2", "--nproc_per_node", "2", "--log_dir", "logs", PROBE, "--nproc", "2", env=OUTER
    )
    rc, out, err = finish(proc, 45)
    assert rc == 0, err
    recs = records(probe_dir)
    assert sorted(recs) == ["trainer.0.0", "trainer.0.1", "trainer.1.0", "trainer.1.1"]
    masters = set()
    for name, rec in recs.items():
        node, local_rank = map(int, name.split(".")[1:])
        env = parsed(rec)
        assert env.collective and env.pservers == [] and rec["env"]["PADDLE_PSERVERS_IP_PORT_LIST"] is None
        assert (env.trainers, env.trainer_id, env.local_rank, env.local_world_size) == (
            2,
            node,
            local_rank,
            2,
        )
        assert (env.rank, env.world_size) == (node * 2 + local_rank, 4)
        masters.add(env.node.init_method)
        assert rec["env"]["CUDA_VISIBLE_DEVICES"] == "0,1,2,3"  # no --gpus: the launcher's, unchanged
        assert f"rank {node * 2 + local_rank}/4" in table_row(out, rec)
    (master,) = masters
    assert master.startswith("tcp://127.0.0.1:") and master != "tcp://127.0.0.1:1"
    assert_all_gone(recs)


@pytest.mark.timeout(60)
def test_a_killed_local_rank_fails_the_job_naming_its_node(run_launcher, tmp_path, probe_dir):
    term_timeout = 20.0
    proc = run_launcher(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--nproc_per_node",
        "2",
        "--term_timeout",
        str(term_timeout),
        "--log_dir",
        "logs",
        PROBE,
        "--nproc",
        "2",
        "--kill",
        "1.1",
    )
    rc, out, err = finish(proc, 45)
    assert rc == 1, err
    killed_at = json.loads((probe_dir / "trainer.1.1.killed").read_text())["at"]
    # The promise, fail fast: the death stops the job at once (the node's other rank is not left to wait in
    # its collective), and roles that obey SIGTERM (all of them here) are not held for --term_timeout, so
    # the launcher is gone before term_timeout has passed since the kill.
    assert time.time() - killed_at < term_timeout
    recs = records(probe_dir)
    pid = recs["trainer.1.1"]["pid"]
    assert (
        f"ps-launch: trainer node 1 local rank 1 (pid {pid}) was killed by SIGKILL; stopped every other role"
        in err
    ), err
    assert "the other local ranks of trainer node 1" in err
    assert "last lines of logs/workerlog.1.1" in err and "trainer.1.1: killing myself" in err
    # Its node's other process (waiting, as in a collective) and every other role were stopped.
    assert sorted(recs) == ["pserver.0", "trainer.0.0", "trainer.0.1", "trainer.1.0", "trainer.1.1"]
    for name in ("pserver.0", "trainer.0.0", "trainer.0.1", "trainer.1.0"):
        assert (probe_dir / f"{name}.sigterm").exists(), name
    assert_all_gone(recs)


@pytest.mark.timeout(60)
def test_gpu_mismatch_is_refused_before_anything_starts(run_launcher, tmp_path, probe_dir):
    proc = run_launcher(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--nproc_per_node",
        "4",
        "--gpus",
        "0,1",
        "--log_dir",
        "logs",
        PROBE,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    rc, out, err = finish(proc, 45)
    assert rc == 2
    assert (
        "ps-launch: error: --nproc_per_node 4 x 1 trainer node(s) on this host need 4 GPUs, --gpus lists 2"
        in err
    )
    assert not records(probe_dir) and not (tmp_path / "logs").exists()
