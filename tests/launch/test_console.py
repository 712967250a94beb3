"""ps-launch as a user sees it: the job's output on the console, and the launcher's own rules.

Real processes on loopback: the CTR example (trainer 0's progress and AUC on
the launcher's stdout, prefixed; the run tests/examples/test_ctr_example.py checks too), and probe
scripts for the launcher's rules (a restart budget running out, a trainer node restarting as a
whole, --show and --log_level). A real job's roles killed and restarted: test_restart_job.py.
"""

from __future__ import annotations

import json
import re
import signal

import pytest

from tests.helpers import paths
from tests.helpers.launch import kill_role, pid_alive, prefixed, records, restarted

pytestmark = pytest.mark.processes

REPO = paths.REPO
RECOVERY = str(REPO / "tests" / "scripts" / "recovery_job.py")
PROBE = str(REPO / "tests" / "scripts" / "role_probe.py")
NODE_PROBE = str(REPO / "tests" / "scripts" / "node_probe.py")


# ---------------------------------------------------------------- the CTR example on the console


@pytest.mark.timeout(180)  # about 20-40 s on 2 cores; the bound leaves room for a loaded machine
def test_ctr_example_shows_trainer_0_progress_and_auc_on_the_console(ctr_sync_job):
    # The CTR example's sync run on a Criteo-format file, with --log_level info (the conftest fixture runs it
    # once; tests/examples/test_ctr_example.py checks its training and files).
    job = ctr_sync_job
    assert job.returncode == 0, job.stdout[-4000:] + job.stderr[-4000:]
    out = job.stdout
    trainer0 = prefixed(out, "trainer0")
    # tqdm's '\r' updates arrive as whole lines (a pipe is no terminal), its final state included.
    bars = [line for line in trainer0 if re.match(r"train:\s+\d+%\|", line)]
    assert bars and re.match(r"train:\s+100%\|", bars[-1]), out
    (auc,) = [line for line in trainer0 if "test AUC" in line]
    assert re.search(r"AUC 0\.\d+", auc), auc
    # Every 100 steps (--metrics_every) the job's training AUC, reduced over both trainers, in trainer 0's
    # log.
    assert [line for line in trainer0 if "the job's training AUC" in line], out
    assert not any(
        line.startswith(("[trainer1]", "[pserver")) for line in out.splitlines()
    )  # default: trainer 0
    assert "\r" not in out and len(bars) >= 2  # the first state and at least the last
    # The table first, the launcher's last word after trainer 0's last line.
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["ROLE", "INDEX"]
    assert lines.index(f"[trainer0] {auc}") < lines.index("ps-launch: all roles finished")
    # Every role's full log in log/, as before: the bar's raw '\r' updates, the AUC, the other roles.
    log0 = job.log("workerlog.0")
    assert auc in log0 and "\r" in log0 and "100%|" in log0
    assert "RESULT " in job.log("workerlog.1")
    for name in ("serverlog.0", "serverlog.1"):
        assert "all 2 trainers closed" in job.log(name)
    assert {r["name"]: r["returncode"] for r in json.loads(job.log("roles.json"))["roles"]} == {
        "pserver.0": 0,
        "pserver.1": 0,
        "trainer.0": 0,
        "trainer.1": 0,
    }


# ---------------------------------------------------------------- the launcher's rules, with probe scripts


@pytest.mark.timeout(60)
def test_a_role_out_of_restarts_stops_the_job_naming_it(launcher, tmp_path):
    job = launcher(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--max_restarts",
        "1",
        "--show",
        "pserver0",
        PROBE,
        "--trainer",
        "hang",
        "--pserver",
        "forever",
    )
    probe = tmp_path / "probe"
    job.wait_until(lambda: len(records(probe)) == 3 and len(job.roles()) == 3, "every role to start", 30)
    first = kill_role(job, "pserver.0")
    # Started again: same role variables, a new process, recorded by roles.json and the log.
    job.wait_until(
        lambda: records(probe)["pserver.0"]["pid"] not in (first,) and restarted(job, "pserver.0", first),
        "pserver.0 to be restarted",
        30,
    )
    second = job.roles()["pserver.0"]["pid"]
    assert records(probe)["pserver.0"]["pid"] == second
    kill_role(job, "pserver.0")
    assert job.finish(45) == 1
    err = job.err()
    assert f"ps-launch: pserver.0 was killed by SIGKILL; restart 1 of 1: started again as pid {second}" in err
    assert (
        "ps-launch: pserver.0 was killed by SIGKILL with no restarts left (1 of 1 used); "
        "stopped every other role"
    ) in err
    log = job.log("serverlog.0")
    assert log.count("pserver.0 started (pid") == 2
    assert "===== ps-launch: pserver.0 was killed by SIGKILL; restart 1 of 1 =====" in log
    # The shown pserver's lines on the console, both processes'; the trainers were stopped.
    assert prefixed(job.out(), "pserver0")[:1] == [f"pserver.0 started (pid {first})"]
    assert f"pserver.0 started (pid {second})" in prefixed(job.out(), "pserver0")
    assert (probe / "trainer.0.sigterm").exists() and (probe / "trainer.1.sigterm").exists()
    assert not any(pid_alive(r["pid"]) for r in job.roles().values())


@pytest.mark.timeout(60)
def test_sigterm_after_a_restart_stops_every_role(launcher, tmp_path):
    job = launcher(
        "--server_num",
        "1",
        "--worker_num",
        "1",
        "--max_restarts",
        "3",
        PROBE,
        "--trainer",
        "hang",
        "--pserver",
        "forever",
    )
    probe = tmp_path / "probe"
    job.wait_until(lambda: len(records(probe)) == 2 and len(job.roles()) == 2, "every role to start", 30)
    first = kill_role(job, "trainer.0")
    job.wait_until(lambda: records(probe)["trainer.0"]["pid"] != first, "trainer.0's new process", 30)
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish(30) == 143
    assert "ps-launch: SIGTERM received; stopping 2 roles" in job.err()
    # Both live processes (the restarted trainer among them) got SIGTERM and are gone; no restart after.
    assert (probe / "trainer.0.sigterm").exists() and (probe / "pserver.0.sigterm").exists()
    final = job.roles()
    assert (final["trainer.0"]["restarts"], final["trainer.0"]["returncode"]) == (1, 0)
    assert final["trainer.0"]["pid"] == records(probe)["trainer.0"]["pid"]
    assert not any(pid_alive(r["pid"]) for r in final.values())


@pytest.mark.timeout(60)
def test_a_failing_trainer_is_restarted_until_its_budget_is_spent(launcher, tmp_path):
    job = launcher(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--max-restarts",
        "2",
        PROBE,
        "--trainer",
        "fail",
        "--fail_id",
        "1",
        "--pserver",
        "forever",
    )
    assert job.finish(45) == 1, job.story()
    err = job.err()
    assert "trainer.1 exited with code 3; restart 1 of 2: started again as pid" in err
    assert "trainer.1 exited with code 3; restart 2 of 2: started again as pid" in err
    assert "trainer.1 exited with code 3 with no restarts left (2 of 2 used); stopped every other role" in err
    assert job.log("workerlog.1").count("boom, the training step failed") == 3
    assert job.roles()["trainer.1"]["restarts"] == 2 and job.roles()["trainer.0"]["restarts"] == 0


@pytest.mark.timeout(60)
def test_a_trainer_node_restarts_as_a_whole(launcher, tmp_path):
    # node_probe --kill 1.1: local rank 1 of node 1 SIGKILLs itself once everyone started, every time.
    job = launcher(
        "--server_num",
        "1",
        "--worker_num",
        "2",
        "--nproc_per_node",
        "2",
        "--max_restarts",
        "1",
        NODE_PROBE,
        "--nproc",
        "2",
        "--kill",
        "1.1",
    )
    assert job.finish(45) == 1, job.story()
    err = job.err()
    m = re.search(
        r"trainer node 1 local rank 1 \(pid \d+\) was killed by SIGKILL; restart 1 of 1: "
        r"trainer node 1 started again \(pids (\d+), (\d+)\)",
        err,
    )
    assert m, err
    # Both local ranks are new processes (the table lists the first ones); the surviving one was
    # stopped first, as its collectives broke. Rank 1's new process recorded itself before dying again.
    first = {row.split()[-2] for row in job.out().splitlines() if row.split()[:2] == ["TRAINER", "1"]}
    assert len(first) == 2 and not first & {m.group(1), m.group(2)}
    assert records(tmp_path / "probe")["trainer.1.1"]["pid"] == int(m.group(2))
    assert [job.roles()[n]["pid"] for n in ("trainer.1.0", "trainer.1.1")] == [
        int(m.group(1)),
        int(m.group(2)),
    ]
    assert "===== ps-launch: trainer node 1 local rank 1" in job.log("workerlog.1")
    assert "with no restarts left (1 of 1 used)" in err
    assert {n: r["restarts"] for n, r in job.roles().items()} == {
        "pserver.0": 0,
        "trainer.0.0": 0,
        "trainer.0.1": 0,
        "trainer.1.0": 1,
        "trainer.1.1": 1,
    }


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "show, level, tags",
    [
        ("all", "INFO", {"pserver0", "pserver1", "trainer0", "trainer1"}),
        ("none", "INFO", set()),
        ("trainer1,pserver0", "WARNING", {"trainer1", "pserver0"}),
    ],
)
def test_show_and_log_level(launcher, tmp_path, show, level, tags):
    job = launcher("--server_num", "2", "--worker_num", "2", "--show", show, "--log_level", level, PROBE)
    assert job.finish(45) == 0, job.story()
    out = job.out()
    shown = {m.group(1) for m in re.finditer(r"^\[(\w+)\] ", out, re.M)}
    assert shown == tags
    for tag in tags:
        kind, index = tag[:-1], tag[-1]
        assert f"[{tag}] {kind}.{index} started (pid" in out
    # WARNING: no table, no progress words from the launcher; nothing went wrong, so nothing at all.
    launcher_lines = [line for line in out.splitlines() if not line.startswith("[")]
    if level == "INFO":
        assert launcher_lines[0].split()[:2] == ["ROLE", "INDEX"] and "ps-launch: all roles finished" in out
    else:
        assert launcher_lines == [] and job.err() == ""
