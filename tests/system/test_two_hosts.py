"""Two "hosts" over a real (virtual) link: pservers and trainers in separate network namespaces.

Namespace 1 holds the two pservers, each bound to its own 10.231.N.1:PORT address; namespace 2
holds the two trainers. The namespaces are joined by a veth pair, so every push and pull crosses
a real interface (not loopback), which the veth's byte counters confirm. Needs root (or
CAP_NET_ADMIN + CAP_SYS_ADMIN) and ``ip netns``; skipped otherwise, naming the failing command,
or failed instead under ``PS_REQUIRE_SYSTEM_TESTS=1``, as in CI (:mod:`tests.helpers.system`).

Select it with ``python -m pytest -q tests/system/test_two_hosts.py -rs``.
"""

from __future__ import annotations

import errno
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import List

import pytest

from harness.netns import clear_namespace, in_ns, run, without_proxies
from tests.helpers import paths
from tests.helpers.system import missing_prerequisites, unavailable

# Every test here starts pservers and trainers as separate processes.
pytestmark = pytest.mark.processes

REPO = paths.REPO
EXAMPLE = str(REPO / "examples" / "train_mlp.py")

PID = os.getpid()
NS1, NS2 = f"ps-h1-{PID}", f"ps-h2-{PID}"  # pservers, trainers
VETH1, VETH2 = f"psv1-{PID}", f"psv2-{PID}"  # <= 15 characters for any pid up to 2**22
SUBNET = f"10.231.{PID % 250}"
IP1, IP2 = f"{SUBNET}.1", f"{SUBNET}.2"
# Ports below the usual ephemeral range (32768+), so that nothing in the root namespace is likely
# to hold them by chance (checked below: they must be refused there).
PORTS = [20000 + 2 * (PID % 5000), 20001 + 2 * (PID % 5000)]

TRAINERS_DEADLINE = 150.0  # both trainers, from their start
PSERVERS_DEADLINE = 30.0  # the pservers, once the trainers are done
MIN_BYTES = 100_000  # each direction of the veth


@dataclass
class TwoHosts:
    procs: List[subprocess.Popen] = field(default_factory=list)

    def counters(self, ns: str, dev: str) -> dict:
        out = {}
        for name in ("rx_bytes", "tx_bytes"):
            r = run(in_ns(ns, "cat", f"/sys/class/net/{dev}/statistics/{name}"), check=False)
            assert r.returncode == 0, f"reading {name} of {dev} in {ns}: {r.stderr}"
            out[name] = int(r.stdout.strip())
        return out


def kill_all(procs: List[subprocess.Popen]) -> None:
    """SIGKILL each process's group (every one runs in its own session) and reap it."""
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # pgid == pid: start_new_session=True
        except ProcessLookupError:
            pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def teardown_network(created_ns: List[str]) -> None:
    """Delete the namespaces (and whatever still runs in them) and any veth end left in the root namespace."""
    for ns in created_ns:
        clear_namespace(ns)  # deleting it also removes the veth end inside it
    # If setup stopped before both ends were moved, an end may still be in the root namespace.
    for dev in (VETH1, VETH2):
        if run(["ip", "link", "show", dev], check=False).returncode == 0:
            run(["ip", "link", "del", dev], check=False)


@pytest.fixture(scope="module")
def two_hosts():
    """Both namespaces joined by the veth pair; every process started in them and the network are gone
    afterwards."""
    reason = missing_prerequisites(["ip"], "apt-get install iproute2")
    if reason:
        unavailable(reason)
    created_ns: List[str] = []
    steps = [
        ["ip", "netns", "add", NS1],
        ["ip", "netns", "add", NS2],
        in_ns(NS1, "true"),  # `ip netns exec` must be able to remount /sys in a container
        ["ip", "link", "add", VETH1, "type", "veth", "peer", "name", VETH2],
        ["ip", "link", "set", VETH1, "netns", NS1],
        ["ip", "link", "set", VETH2, "netns", NS2],
        in_ns(NS1, "ip", "addr", "add", f"{IP1}/24", "dev", VETH1),
        in_ns(NS2, "ip", "addr", "add", f"{IP2}/24", "dev", VETH2),
        in_ns(NS1, "ip", "link", "set", "lo", "up"),
        in_ns(NS2, "ip", "link", "set", "lo", "up"),
        in_ns(NS1, "ip", "link", "set", VETH1, "up"),
        in_ns(NS2, "ip", "link", "set", VETH2, "up"),
    ]
    hosts = TwoHosts()
    try:
        for cmd in steps:
            r = run(cmd, check=False)
            if r.returncode != 0:
                # Inside the try: the finally below removes what the earlier steps created.
                unavailable(
                    f"network namespace setup failed (needs root / CAP_NET_ADMIN and namespaces "
                    f"allowed): `{' '.join(cmd)}` exited {r.returncode}: "
                    f"{(r.stderr or r.stdout).strip()}"
                )
            if cmd[:3] == ["ip", "netns", "add"]:
                created_ns.append(cmd[3])
        yield hosts
    finally:
        kill_all(hosts.procs)
        teardown_network(created_ns)


def start_role(hosts: TwoHosts, ns: str, env: dict, log: Path, cwd: Path, *args: str) -> subprocess.Popen:
    """``ip netns exec NS env VAR=... python examples/train_mlp.py ARGS``, in its own session."""
    base = without_proxies(dict(os.environ))  # gRPC would try to reach 10.231.x.x through a proxy
    env = {"PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", **env}
    argv = in_ns(ns, "env", *(f"{k}={v}" for k, v in env.items()), sys.executable, EXAMPLE, *args)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            argv,
            cwd=cwd,
            env=base,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    hosts.procs.append(proc)
    return proc


def wait_until(predicate, deadline: float, what: str) -> None:
    """Poll ``predicate`` until true; fail naming ``what`` once ``deadline`` (monotonic) passed."""
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def tail(path: Path, n: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def refused(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(5)
        return s.connect_ex((host, port)) == errno.ECONNREFUSED


@pytest.mark.timeout(200, method="signal")  # SIGALRM: the fixtures' teardown still runs
def test_sync_job_across_two_network_namespaces(two_hosts, tmp_path):
    endpoints = [f"{IP1}:{port}" for port in PORTS]
    common = {"PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints), "PADDLE_TRAINERS_NUM": "2"}
    # ~0.97 test accuracy (0.967 in one process on the same batches; the default is 20 epochs). The
    # namespaces share this host's memory, where two hosts would not: every byte goes over TCP.
    args = ["--epochs", "6", "--no_shared_memory"]
    before = two_hosts.counters(NS1, VETH1)

    pservers, ps_logs = [], []
    for i, port in enumerate(PORTS):
        log = tmp_path / f"serverlog.{i}"
        ps_logs.append(log)
        pservers.append(
            start_role(
                two_hosts,
                NS1,
                {**common, "TRAINING_ROLE": "PSERVER", "POD_IP": IP1, "PADDLE_PORT": str(port)},
                log,
                tmp_path,
                *args,
            )
        )

    # Each pserver bound its namespace address: wait for its "serving" line (or its death).
    deadline = time.monotonic() + 60
    for proc, log, ep in zip(pservers, ps_logs, endpoints):
        wait_until(
            lambda: proc.poll() is not None or f"pserver {ep} serving" in log.read_text(errors="replace"),
            deadline,
            f"pserver {ep} to serve",
        )
        assert proc.poll() is None, f"pserver {ep} exited {proc.returncode}:\n{tail(log)}"

    # Bound to 10.231.x.1 only, never 0.0.0.0: loopback refuses its port inside namespace 1, and
    # the root namespace (another network stack) does not see it on 127.0.0.1 either.
    for port in PORTS:
        probe = (
            f"import socket,errno; s=socket.socket(); s.settimeout(5); "
            f"raise SystemExit(0 if s.connect_ex(('127.0.0.1',{port}))==errno.ECONNREFUSED else 1)"
        )
        r = run(in_ns(NS1, sys.executable, "-I", "-c", probe), check=False)
        assert r.returncode == 0, f"127.0.0.1:{port} inside {NS1} was not refused: {r.stderr}"
        assert refused("127.0.0.1", port), f"127.0.0.1:{port} in the root namespace was not refused"

    trainers, tr_logs = [], []
    for i in range(2):
        log = tmp_path / f"workerlog.{i}"
        tr_logs.append(log)
        trainers.append(
            start_role(
                two_hosts,
                NS2,
                {**common, "TRAINING_ROLE": "TRAINER", "PADDLE_TRAINER_ID": str(i)},
                log,
                tmp_path,
                *args,
                "--save",
                str(tmp_path / "mlp_state_dict.pt"),
            )
        )

    deadline = time.monotonic() + TRAINERS_DEADLINE
    for i, proc in enumerate(trainers):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"trainer {i} still running after {TRAINERS_DEADLINE} s:\n{tail(tr_logs[i])}")
        assert proc.returncode == 0, f"trainer {i} exited {proc.returncode}:\n{tail(tr_logs[i])}"

    # The pservers leave by themselves once both trainers closed.
    deadline = time.monotonic() + PSERVERS_DEADLINE
    for i, proc in enumerate(pservers):
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"pserver {i} did not exit within {PSERVERS_DEADLINE} s of the trainers:\n{tail(ps_logs[i])}"
            )
        assert proc.returncode == 0, f"pserver {i} exited {proc.returncode}:\n{tail(ps_logs[i])}"

    after = two_hosts.counters(NS1, VETH1)

    log0 = tr_logs[0].read_text(errors="replace")
    found = re.findall(r"trainer 0: test accuracy ([0-9.]+) \(sync mode", log0)
    assert found and float(found[0]) >= 0.9, tail(tr_logs[0])
    assert (tmp_path / "mlp_state_dict.pt").exists()

    for ep, log in zip(endpoints, ps_logs):
        text = log.read_text(errors="replace")
        for trainer_id in (0, 1):
            assert f"{ep}: trainer {trainer_id} joined" in text, tail(log)
            assert f"{ep}: trainer {trainer_id} closed" in text, tail(log)
        assert f"pserver {ep}: all 2 trainers closed" in text, tail(log)

    # Gradients came in (rx on the pserver side) and parameters went out (tx) over the veth.
    moved = {k: after[k] - before[k] for k in before}
    assert moved["rx_bytes"] > MIN_BYTES and moved["tx_bytes"] > MIN_BYTES, moved
