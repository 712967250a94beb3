"""ps-launch as a user sees it: the job's output on the console, and roles restarted with --max_restarts.

Real processes on loopback: the CTR example (trainer 0's progress and AUC on
the launcher's stdout, prefixed; the run tests/examples/test_ctr_example.py checks too), the
recovery job (tests/scripts/recovery_job.py) with a pserver and a trainer SIGKILLed
mid-run and restarted by the launcher (the sync model must equal an uninterrupted
run's), and probe scripts for the
launcher's own rules (a restart budget running out, a trainer node restarting
as a whole, --show and --log_level).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest
import torch

from tests.helpers import paths
from tests.helpers.jobs import assert_job_models_close
from tests.helpers.launch import pid_alive, records
from tests.scripts import recovery_job

pytestmark = pytest.mark.processes

REPO = paths.REPO
RECOVERY = str(REPO / "tests" / "scripts" / "recovery_job.py")
PROBE = str(REPO / "tests" / "scripts" / "role_probe.py")
NODE_PROBE = str(REPO / "tests" / "scripts" / "node_probe.py")


class Launcher:
    """``python -m trainer.launch ARGS`` in ``cwd``, its stdout and stderr in files (a pipe nobody reads
    would fill up and stall it). :meth:`close` stops it and SIGKILLs any role it left."""

    def __init__(self, cwd: Path, *argv: str, log_dir: str = "logs") -> None:
        self.cwd, self.log_dir = cwd, cwd / log_dir
        self.out_path, self.err_path = cwd / "launcher.out", cwd / "launcher.err"
        if log_dir != "log":  # "log" is the launcher's default: left out, so that the default is what runs
            argv = ("--log_dir", log_dir, *argv)
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.launch", *argv],
                cwd=cwd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        self.seen_pids: set = set()

    # Bytes decoded, not read_text(): universal newlines would turn every '\r' into '\n'.
    def out(self) -> str:
        return self.out_path.read_bytes().decode(errors="replace")

    def err(self) -> str:
        return self.err_path.read_bytes().decode(errors="replace")

    def roles(self) -> Dict[str, dict]:
        """roles.json by role name ({} until the launcher wrote it)."""
        try:
            listed = json.loads((self.log_dir / "roles.json").read_text())["roles"]
        except (OSError, ValueError, KeyError):
            return {}
        found = {r["name"]: r for r in listed}
        self.seen_pids |= {r["pid"] for r in listed if r["pid"]}
        return found

    def log(self, name: str) -> str:
        return (self.log_dir / name).read_bytes().decode(errors="replace")

    def wait_until(self, ready, what: str, timeout: float):
        """Poll ``ready()``; fail (with the console and logs) on the deadline or if the launcher exits
        first."""
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value:
                return value
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"waiting for {what}: launcher exit code {self.proc.poll()}\n{self.story()}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"ps-launch did not finish within {timeout} s\n{self.story()}")

    def story(self) -> str:
        logs = "".join(
            f"\n===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*log.*"))
        )
        return f"===== stdout\n{self.out()[-4000:]}\n===== stderr\n{self.err()[-4000:]}{logs}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher stops its roles on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.roles()
        for pid in self.seen_pids:  # the launcher's own clean-up is under test: do not rely on it
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    """Start a :class:`Launcher` in tmp_path (PROBE_DIR set for the probe scripts); closed at teardown."""
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    monkeypatch.delenv("PS_LOG_LEVEL", raising=False)
    started: List[Launcher] = []

    def start(*argv: str, log_dir: str = "logs") -> Launcher:
        started.append(Launcher(tmp_path, *argv, log_dir=log_dir))
        return started[-1]

    yield start
    for one in started:
        one.close()


def prefixed(out: str, tag: str) -> List[str]:
    return [line[len(tag) + 3 :] for line in out.splitlines() if line.startswith(f"[{tag}] ")]


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


# ---------------------------------------------------------------- restarts of a real job

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


def kill_role(job: Launcher, name: str) -> int:
    """SIGKILL the live process of role ``name`` (its pid from roles.json); returns the pid."""
    pid = job.roles()[name]["pid"]
    assert pid_alive(pid), f"{name} (pid {pid}) is not running\n{job.story()}"
    os.kill(pid, signal.SIGKILL)
    return pid


def restarted(job: Launcher, name: str, old_pid: int) -> Optional[dict]:
    role = job.roles().get(name)
    return role if role and role["pid"] != old_pid and role["restarts"] == 1 else None


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
