"""A real, single-member etcd server, for hot standby's coordination (pserver/replication).

The coordination layer's guarantees (one winner per campaign, leases that expire when their holder
dies, fencing by create revision) are etcd's, so the tests of the replicas and the hot-standby
benchmarks (``bench_replication``, ``bench_failover``) run against the real server started the way
users start it: its own process (in a session of its own, killed if its starter dies), its own data
directory, loopback peer URL. Where ``etcd`` is not installed :func:`start_etcd` raises
:class:`EtcdMissing`: the tests skip on it (``tests/helpers/etcd.py``), a benchmark stops.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Union

from harness.ports import free_ports
from harness.processes import RunFailed, die_with_parent

INSTALL = "apt-get install etcd-server"
START_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
# etcd raises every lease TTL below 1.5 x the election timeout to that, rounded up to whole
# seconds: with its default 1000 ms a 1 s lease silently becomes 2 s. 500 ms (10 heartbeats of
# 50 ms) makes the minimum 0.75 s -> 1 s, so a 1 s lease is really 1 s.
TIMING_FLAGS = ["--heartbeat-interval", "50", "--election-timeout", "500"]


class EtcdMissing(RunFailed):
    """``etcd`` is not on PATH; the message says how to install it."""


class EtcdServer:
    """One etcd process answering at :attr:`url`; a context manager that stops it on exit.

    The process leads a process group of its own: :meth:`stop` and :meth:`kill` signal the group,
    and only while its leader is unreaped, so its id cannot have been reused by another process.
    """

    def __init__(self, proc: subprocess.Popen, url: str, data_dir: Path, log_path: Path):
        self.proc = proc
        self.url = url
        self.data_dir = data_dir
        self.log_path = log_path

    @property
    def pid(self) -> int:
        """The etcd process's id."""
        return self.proc.pid

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of etcd's log (stdout and stderr)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as e:
            return f"(no log: {e})"

    def healthy(self) -> bool:
        """Whether etcd answers ``/health`` with ``{"health": "true"}`` right now (one short request)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> None:
        """Return once etcd is healthy; raise RunFailed naming the log's tail if it exits or ``timeout``
        passes."""
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if self.proc.poll() is not None:
                raise RunFailed(
                    f"etcd exited with {self.proc.returncode} before answering at {self.url}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"etcd did not answer at {self.url}/health within {timeout:g}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)  # poll interval of the health check

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it has not exited within a few seconds; always reaped; idempotent."""
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
        self.proc.wait()

    def kill(self) -> None:
        """SIGKILL (a crash: no clean shutdown) and reap; idempotent."""
        self._signal(signal.SIGKILL)
        self.proc.wait()

    def __enter__(self) -> "EtcdServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def start_etcd(work_dir: Union[str, os.PathLike], name: str = "etcd", host: str = "127.0.0.1") -> EtcdServer:
    """Start a single-member etcd on free ports with its data and log under ``work_dir``; wait until healthy.

    ``name`` names the member and its files (``work_dir/NAME.data``, ``work_dir/NAME.log``), so a caller
    may start several. ``host`` is the address its client URL binds (an address of this host that
    processes in another network namespace can reach, e.g. a veth end's); the peer URL stays on loopback.
    Raises :class:`EtcdMissing` when ``etcd`` is not on PATH, and RunFailed with the log's tail when it
    does not come up within 15 s. A port taken between picking and binding it (another process's) is
    retried with new ports.
    """
    binary = shutil.which("etcd")
    if binary is None:
        raise EtcdMissing(f"not installed: etcd (not on PATH={os.environ.get('PATH', '')!r}; {INSTALL})")
    data_dir = Path(work_dir) / f"{name}.data"
    log_path = Path(work_dir) / f"{name}.log"
    for attempt in range(3):
        client_port, peer_port = free_ports(2)
        url = f"http://{host}:{client_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        cmd = [
            binary,
            "--name",
            name,
            "--data-dir",
            str(data_dir),
            "--listen-client-urls",
            url,
            "--advertise-client-urls",
            url,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"{name}={peer}",
            "--initial-cluster-state",
            "new",
            *TIMING_FLAGS,
        ]
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        server = EtcdServer(proc, url, data_dir, log_path)
        try:
            server.wait_healthy()
            return server
        except BaseException:
            server.kill()
            if attempt < 2 and "address already in use" in server.log_tail():
                shutil.rmtree(data_dir, ignore_errors=True)
                continue
            raise
    raise AssertionError("unreachable")
