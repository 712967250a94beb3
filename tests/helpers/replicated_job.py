"""A job of real processes with hot-standby pservers: tests/scripts/recovery_job.py, two processes per shard.

Shard k is served by ``pserver{k}`` (at ``endpoints[k]``) and ``replica{k}`` (at
``backups[k]``); etcd decides which leads. The variables ps-launch sets
(``PS_SERVER_REPLICAS``, ``PS_REPLICA_ENDPOINTS``, ``PS_COORDINATOR``) carry the
replication settings to the script, which does nothing special for them.
"""

from __future__ import annotations

import re
import time
from typing import Dict, List, Optional, Tuple

import grpc

from harness.ports import free_ports
from psproto import ps_pb2, ps_pb2_grpc

from .jobs import Job

# What the trainers' logs say when a recovery rolls them back (trainer/recovery/healer.py).
ROLLBACK_LINES = re.compile(r"rolling every pserver back|steps \d+\.\.\d+ are|rolled back from step")


class ReplicatedJob(Job):
    """Every role of the job, each shard on two processes; ``etcd_url`` is the coordinator."""

    def __init__(self, tmp_path, etcd_url: str, n_pservers: int = 2, n_trainers: int = 2, args=()):
        super().__init__(tmp_path, n_pservers, n_trainers, args)
        self.backups = [f"127.0.0.1:{p}" for p in free_ports(n_pservers)]
        self.etcd_url = etcd_url

    def env(self, role: str, index: int, endpoints=None) -> dict:
        replica = role == "REPLICA"
        env = super().env("PSERVER" if replica else role, index, endpoints)
        env.update(
            PS_SERVER_REPLICAS="2", PS_REPLICA_ENDPOINTS=",".join(self.backups), PS_COORDINATOR=self.etcd_url
        )
        if replica:
            host, port = self.backups[index].rsplit(":", 1)
            env.update(POD_IP=host, PADDLE_PORT=port)
        return env

    def start_all(self) -> None:
        for i in range(len(self.endpoints)):
            self.start("PSERVER", i)
            self.start("REPLICA", i)
        for i in range(self.n_trainers):
            self.start("TRAINER", i)

    def address(self, name: str) -> str:
        """The endpoint of process ``pserverK`` or ``replicaK``."""
        k = int(name[-1])
        return self.endpoints[k] if name.startswith("pserver") else self.backups[k]

    def ask(self, name: str, method: str, request, timeout: float):
        """One unary call to process ``name``; its answer, or None when it does not answer."""
        with grpc.insecure_channel(self.address(name)) as ch:
            try:
                return getattr(ps_pb2_grpc.ParameterServerStub(ch), method)(request, timeout=timeout)
            except grpc.RpcError:
                return None

    def lead(self, name: str, timeout: float = 1.0) -> Optional[ps_pb2.LeadReply]:
        """What process ``name`` says of its shard's lead (None: it does not answer)."""
        return self.ask(name, "Lead", ps_pb2.LeadRequest(), timeout)

    def stats(self, name: str, timeout: float = 2.0) -> Optional[ps_pb2.StatsReply]:
        return self.ask(name, "Stats", ps_pb2.StatsRequest(), timeout)

    def roles(self, shard: int) -> Tuple[str, str]:
        """(the primary's name, the backup's name) of ``shard``, as the processes say now."""
        names = (f"pserver{shard}", f"replica{shard}")
        leads = {n: self.lead(n) for n in names}
        primary = [n for n, r in leads.items() if r is not None and r.role == "primary"]
        assert len(primary) <= 1, f"two primaries of shard {shard}: {leads}"
        if not primary:
            return "", ""
        return primary[0], next(n for n in names if n != primary[0])

    def wait_in_sync(self, shard: int, timeout: float = 60.0) -> Tuple[str, str]:
        """Wait until ``shard`` has a primary whose backup is in sync; (primary, backup).

        The backup process itself must say it follows: just after a kill the primary may not have noticed
        it yet and still report its backup in sync."""
        found: Dict[str, Tuple[str, str]] = {}

        def ready() -> bool:
            primary, backup = self.roles(shard)
            if not primary:
                return False
            follows = self.lead(backup)
            stats = self.stats(primary)
            ok = (
                follows is not None
                and follows.role == "backup"
                and stats is not None
                and stats.replica.backup_in_sync
            )
            if ok:
                found["pair"] = (primary, backup)
            return ok

        self.wait_until(ready, f"shard {shard} in sync", timeout)
        return found["pair"]

    def rollback_lines(self) -> List[str]:
        """Every log line of the job that tells of a roll-back."""
        return [line for k in self.logs for line in self.log(k).splitlines() if ROLLBACK_LINES.search(line)]

    def restart(self, name: str) -> None:
        """Start ``name`` again with its command (it was killed)."""
        role = "REPLICA" if name.startswith("replica") else "PSERVER"
        self.start(role, int(name[-1]))

    def wait_trainers(self, timeout: float) -> None:
        for i in range(self.n_trainers):
            assert self.wait(f"trainer{i}", timeout) == 0, self.all_logs()

    def finish_pservers(self, timeout: float = 60.0) -> Dict[str, int]:
        """Wait for every pserver process to end on its own (the trainers closed); their exit codes."""
        codes = {}
        deadline = time.monotonic() + timeout
        for name in [n for n in self.procs if n.startswith(("pserver", "replica"))]:
            codes[name] = self.wait(name, max(1.0, deadline - time.monotonic()))
        return codes
