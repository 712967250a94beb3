"""A sync job across four "hosts" started as users start one on real machines: ps-launch on every host.

Four network namespaces on a bridge (``harness/netns.py``): pservers on hosts 1 and 2,
trainers on hosts 3 and 4 (``host_layouts`` "split"). Every host runs the same
``ps-launch --servers ... --workers ... --host ITS_IP tests/scripts/recovery_job.py`` (the recipe of
docs/operations.md, "Jobs across hosts") and starts only its own roles. Shared memory is off (the
namespaces share /dev/shm; real hosts do not), so every push and pull crosses the hosts' links,
which their byte counters confirm. The trained model must equal single-process PyTorch on the
concatenated batches. Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN) and ``ip netns``; skipped
otherwise, naming the failing command, or failed instead under ``PS_REQUIRE_SYSTEM_TESTS=1``, as in CI.
"""

from __future__ import annotations

import os

import pytest
import torch

from harness.host_layouts import parse_layout, per_host_commands
from harness.netns import host_env
from harness.processes import Command
from tests.helpers import paths
from tests.helpers.jobs import assert_job_models_close
from tests.helpers.system import netns_hosts
from tests.scripts import recovery_job

pytestmark = pytest.mark.processes

SCRIPT = str(paths.SCRIPTS / "recovery_job.py")
EPOCHS = 2
DEADLINE = 150.0  # every host's ps-launch, from their start
PORT = 20000 + 4 * (os.getpid() % 5000)
# A trainer pushes its whole gradient and pulls every block each step: 19k float32 (76 KB) each
# way, 20 steps an epoch. What each host's link must at least have carried, each way.
MIN_BYTES = EPOCHS * 20 * 76_000 // 2


@pytest.fixture(scope="module")
def hosts():
    yield from netns_hosts(4)


@pytest.mark.timeout(
    240, method="signal"
)  # SIGALRM: the commands are stopped and the fixture's teardown runs
def test_sync_job_across_four_hosts_launched_per_host_equals_one_process(hosts, tmp_path):
    layout = parse_layout("split")
    out = tmp_path / "out"
    out.mkdir()
    script = [
        SCRIPT,
        "--epochs",
        str(EPOCHS),
        "--checkpoint_dir",
        str(tmp_path / "ckpt"),
        "--out_dir",
        str(out),
        "--no_shared_memory",
        *recovery_job.FLOAT64,
    ]
    commands = per_host_commands(layout, hosts.ip, PORT, lambda h: str(tmp_path / f"host{h}"), script)
    assert sorted(commands) == [1, 2, 3, 4]
    env = {k: v for k, v in host_env().items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
    before = {h: hosts.counters(h) for h in hosts.numbers()}

    started = {}
    try:
        for h, cmd in commands.items():
            started[h] = Command(
                hosts.cmd(h, *cmd), str(tmp_path / f"launch{h}.log"), env=env, cwd=str(paths.REPO)
            )
        codes = {h: c.wait(DEADLINE, f"ps-launch on host {h}") for h, c in started.items()}
    finally:
        for c in started.values():
            c.stop()
    logs = {h: (tmp_path / f"launch{h}.log").read_text(errors="replace")[-3000:] for h in started}
    assert codes == {1: 0, 2: 0, 3: 0, 4: 0}, logs

    # Each host started only its own roles: pserver i on host i + 1, trainer j on host j + 3.
    assert sorted(os.listdir(tmp_path / "host1")) == ["roles.json", "serverlog.0"]
    assert sorted(os.listdir(tmp_path / "host2")) == ["roles.json", "serverlog.1"]
    assert sorted(os.listdir(tmp_path / "host3")) == ["roles.json", "workerlog.0"]
    assert sorted(os.listdir(tmp_path / "host4")) == ["roles.json", "workerlog.1"]

    assert_job_models_close(out, recovery_job.reference(epochs=EPOCHS, dtype=torch.float64))

    moved = {h: hosts.moved(before[h], hosts.counters(h)) for h in hosts.numbers()}
    assert all(m["rx_bytes"] > MIN_BYTES and m["tx_bytes"] > MIN_BYTES for m in moved.values()), moved
