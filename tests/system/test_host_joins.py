"""A new host joins a running sync job across hosts: its pserver is added with ``ps-reshard``, live.

Five network namespaces on a bridge (``harness/netns.py``): pservers on hosts 1 and 2, trainers on hosts
3 and 4, all started as ``ps-launch`` starts a role (its variables, the job's two pservers); mid-training
an operator asks for the three pservers of hosts 1, 2 and 5 and starts host 5's pserver with that list.
Shared memory is off (the namespaces share /dev/shm; hosts do not), so every byte crosses the links. The
job ends with the model of one process on the same data (float64), host 5's link carried its share, and
nothing was restarted. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and ``ip netns``; skipped otherwise,
failed instead under ``PS_REQUIRE_SYSTEM_TESTS=1``, as in CI.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from harness.netns import host_env
from harness.processes import Command
from tests.helpers import paths
from tests.helpers.jobs import assert_job_models_close
from tests.helpers.system import netns_hosts
from tests.scripts import recovery_job
from transpiler.layout.record import read_record_file

pytestmark = pytest.mark.processes

SCRIPT = str(paths.SCRIPTS / "recovery_job.py")
EPOCHS = 8  # 160 steps, 0.1 s each until the change is made (PAUSE_DIR/calm), then at full speed
DEADLINE = 150.0
PORT = 21000 + 4 * (os.getpid() % 5000)


@pytest.fixture(scope="module")
def five_hosts():
    yield from netns_hosts(5, tag=os.getpid() + 7)  # beside test_hosts.py's four, should a worker hold both


def role_env(role: str, pservers, index: int) -> dict:
    """The variables ps-launch gives role ``index`` (a pserver: the one at that position of ``pservers``)."""
    env = {k: v for k, v in host_env().items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
    env.update(TRAINING_ROLE=role, PADDLE_PSERVERS_IP_PORT_LIST=",".join(pservers), PADDLE_TRAINERS_NUM="2")
    if role == "PSERVER":
        env["POD_IP"], env["PADDLE_PORT"] = pservers[index].rsplit(":", 1)
    else:
        env["PADDLE_TRAINER_ID"] = str(index)
    return env


@pytest.mark.timeout(
    240, method="signal"
)  # SIGALRM: the commands are stopped and the fixture's teardown runs
def test_a_new_host_joins_a_running_job_and_it_trains_as_one_process(five_hosts, tmp_path):
    hosts = five_hosts
    out, pause, ckpt = tmp_path / "out", tmp_path / "pause", str(tmp_path / "ckpt")
    out.mkdir()
    pause.mkdir()
    script = [SCRIPT, "--epochs", str(EPOCHS), "--checkpoint_dir", ckpt, "--out_dir", str(out)]
    script += ["--pause_dir", str(pause), "--step_delay", "0.1", "--no_shared_memory", *recovery_job.FLOAT64]
    pservers = [f"{hosts.ip(h)}:{PORT}" for h in (1, 2)]
    grown = pservers + [f"{hosts.ip(5)}:{PORT}"]
    roles = {1: ("PSERVER", pservers, 0), 2: ("PSERVER", pservers, 1)}
    roles.update({3: ("TRAINER", pservers, 0), 4: ("TRAINER", pservers, 1)})
    before = hosts.counters(5)
    started = {}

    def start(h: int, role: str, endpoints, index: int) -> None:
        started[h] = Command(
            hosts.cmd(h, sys.executable, *script),
            str(tmp_path / f"host{h}.log"),
            env=role_env(role, endpoints, index),
            cwd=str(paths.REPO),
        )

    try:
        for h, (role, endpoints, index) in roles.items():
            start(h, role, endpoints, index)
        deadline = time.monotonic() + DEADLINE
        while not any(d.startswith("step-") for d in (os.listdir(ckpt) if os.path.isdir(ckpt) else [])):
            assert time.monotonic() < deadline, "no checkpoint written"
            time.sleep(0.1)
        asking = subprocess.Popen(
            [sys.executable, "-m", "pserver.layout.reshard_cli", "--checkpoint_dir", ckpt, "--pservers",
             ",".join(grown), "--timeout", "90"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=str(paths.REPO),
        )  # fmt: skip
        while getattr(read_record_file(ckpt), "change", None) is None:  # recorded: asked
            assert asking.poll() is None, asking.communicate()[0]
            time.sleep(0.05)
        start(5, "PSERVER", grown, 2)  # the new host's pserver, once asked: it joins at the commit
        said = asking.communicate(timeout=120)[0]
        assert asking.returncode == 0 and "runs layout epoch 1 on 3 pservers" in said, said
        (pause / "calm").touch()
        codes = {h: c.wait(DEADLINE, f"host {h}") for h, c in started.items()}
    finally:
        for c in started.values():
            c.stop()
    logs = {h: (tmp_path / f"host{h}.log").read_text(errors="replace")[-3000:] for h in started}
    assert codes == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0}, logs
    assert "adopted layout epoch 1" in logs[3] and "adopted layout epoch 1" in logs[4]
    assert_job_models_close(out, recovery_job.reference(epochs=EPOCHS, dtype=torch.float64))
    moved = hosts.moved(before, hosts.counters(5))
    assert moved["rx_bytes"] > 100_000 and moved["tx_bytes"] > 100_000, moved  # host 5 served its share
