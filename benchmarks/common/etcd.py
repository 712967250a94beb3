"""etcd for the hot-standby benchmarks: one single-member etcd on loopback, in its own process group.

Hot standby (``server_replicas=2``) needs etcd to decide each shard's primary; ``bench_replication``
and ``bench_failover`` start one for their whole run, as users start it (its own process and data
directory) and as the tests do.
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
from typing import Optional

from benchmarks.common.ports import free_ports
from benchmarks.common.processes import RunFailed, die_with_parent, tail

# etcd's timing as the tests start it: a 1 s lease stays 1 s (tests/helpers/etcd.py explains why).
ETCD_TIMING = ["--heartbeat-interval", "50", "--election-timeout", "500"]
ETCD_START_TIMEOUT = 15.0
STOP_GRACE = 5.0


class Etcd:
    """One single-member etcd on loopback for the whole benchmark, in its own process group.

    Started as the tests start it (``tests/helpers/etcd.py``, copied here: a
    benchmark imports no test code): its own data directory under ``work``, free
    127.0.0.1 client and peer ports, the timing flags of :data:`ETCD_TIMING`.
    A context manager: leaving the ``with`` block stops it.
    :meth:`stop` kills its whole process group (TERM, then KILL) and is idempotent.
    """

    def __init__(self, work: str):
        binary = shutil.which("etcd")
        if binary is None:
            raise RunFailed("etcd is not on PATH (apt-get install etcd-server): hot standby needs it")
        self.log_path = os.path.join(work, "etcd.log")
        self.proc: Optional[subprocess.Popen] = None
        for attempt in range(3):
            data_dir = os.path.join(work, f"etcd.data.{attempt}")
            client, peer = (f"http://127.0.0.1:{p}" for p in free_ports(2))
            self.url = client
            cmd = [
                binary,
                "--name",
                "bench",
                "--data-dir",
                data_dir,
                "--listen-client-urls",
                client,
                "--advertise-client-urls",
                client,
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
                "--initial-cluster",
                f"bench={peer}",
                "--initial-cluster-state",
                "new",
                *ETCD_TIMING,
            ]
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            try:
                self._wait_healthy()
                return
            except RunFailed:
                self.stop()
                if attempt < 2 and "address already in use" in tail(self.log_path, 40):
                    continue  # a port taken between picking and binding it: new ports
                raise

    def _healthy(self) -> bool:
        """Whether etcd answers ``/health`` with ``{"health": "true"}`` right now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1.0) as r:
                return json.loads(r.read()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def _wait_healthy(self) -> None:
        """Return once etcd is healthy; RunFailed with its log's tail if it exits or does not answer in
        time."""
        deadline = time.monotonic() + ETCD_START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RunFailed(
                    f"etcd exited with {self.proc.returncode}; log {self.log_path}:\n{tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                raise RunFailed(
                    f"etcd did not answer at {self.url}/health within {ETCD_START_TIMEOUT:g}s; "
                    f"log {self.log_path}:\n{tail(self.log_path)}"
                )
            time.sleep(0.05)

    def stop(self) -> None:
        """SIGTERM to etcd's process group, SIGKILL after a grace; reaped; idempotent.

        The group is signalled only while its leader is unreaped, so its id
        cannot have been reused by an unrelated process.
        """
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=STOP_GRACE)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def __enter__(self) -> "Etcd":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
