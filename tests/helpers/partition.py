"""A shard whose first process runs in its own network namespace, cut off from the rest on demand.

What tests/system/test_replication_partition.py builds its scenario from: the namespace NS_A joined
to the root namespace by a veth pair (:func:`partition_network`), the job with pserver0 inside NS_A
and its second process, etcd and the trainers outside (:class:`PartitionJob`), the probe that calls
pserver0 from inside NS_A (:data:`PROBE`, its records read by :func:`classify`), the sampler of
both processes' Lead answers (:class:`LeadSampler`) and the log lines the scenario reads.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from concurrent import futures
from datetime import datetime
from typing import Dict, Iterator, List, Optional, Tuple

import pytest
import torch

from harness.netns import clear_namespace, in_ns, run, without_proxies
from harness.ports import free_ports
from tests.helpers.jobs import SCRIPT
from tests.helpers.replicated_job import ReplicatedJob
from tests.helpers.system import missing_prerequisites, unavailable
from tests.scripts import recovery_job

PID = os.getpid()
NS_A = f"ps-pa-{PID}"  # pserver0's "host"
VETH_A, VETH_B = f"pspa-{PID}", f"pspb-{PID}"  # NS_A's end, the root namespace's end (<= 15 characters)
# A /30 of 10.231.x (test_two_hosts uses x.1 and x.2 inside its own namespaces): the root namespace
# gets IP_B, so two concurrent runs of this test must not pick the same one; the offset spreads them.
SUBNET = f"10.231.{PID % 250}"
OFFSET = 4 * (1 + (PID // 250) % 63)
IP_A, IP_B = f"{SUBNET}.{OFFSET + 1}", f"{SUBNET}.{OFFSET + 2}"
PREFIX = 30


FENCED_LINE = re.compile(
    r"^(\S+ \S+) ERROR \S+: replica (\S+): lost the lead of shard 0 \(epoch (\d+)\): fenced", re.M
)
LEADS_LINE = re.compile(
    r"^(\S+ \S+) WARNING \S+: replica (\S+) leads shard 0 at epoch (\d+) \(update (\d+)\)", re.M
)
FOLLOWED_LINE = re.compile(
    r"^(\S+ \S+) WARNING \S+: trainer (\d): \S+ is served by (\S+) now \(epoch (\d+)\)", re.M
)
STOPPED_LINE = re.compile(r"pserver \S+ stopped after (\d+) updates")

# The probe run inside NS_A: after PAUSE_DIR/probe-go it calls pserver0 (Lead, Hello, PushPullOne) in a loop,
# recording each call's wall-clock start and end and its outcome, until GONE_CALLS calls in a row found no
# server (UNAVAILABLE without the replica's "does not lead", or CANCELLED), or 90 s passed; first it tries
# to reach etcd (the partition's other direction). argv: target etcd_host etcd_port digest pause_dir out
# gone_calls.
GONE_CALLS = 12
PROBE = r"""
import json, os, secrets, socket, sys, time
import grpc
from psproto import ps_pb2, ps_pb2_grpc

target, etcd_host, etcd_port, digest, pause, out, gone_calls = sys.argv[1:8]
open(os.path.join(pause, "probe-ready"), "w").close()
deadline = time.monotonic() + 120
while not os.path.exists(os.path.join(pause, "probe-go")):
    if time.monotonic() > deadline:
        sys.exit("no probe-go within 120 s")
    time.sleep(0.005)

s = socket.socket()
s.settimeout(1.0)
try:
    s.connect((etcd_host, int(etcd_port)))
    etcd = "connected"
except OSError as e:
    etcd = f"{type(e).__name__} errno={e.errno}: {e}"
finally:
    s.close()

channel = grpc.insecure_channel(target)
stub = ps_pb2_grpc.ParameterServerStub(channel)
calls = {
    "Lead": lambda: stub.Lead(ps_pb2.LeadRequest(), timeout=1.0),
    "Hello": lambda: stub.Hello(ps_pb2.HelloRequest(trainer_id=0, layout_digest=digest,
                                                    incarnation=secrets.randbits(63) or 1), timeout=1.0),
    "PushPullOne": lambda: stub.PushPullOne(ps_pb2.PushChunk(header=ps_pb2.PushHeader(
        trainer_id=0, step=1, layout_digest=digest)), timeout=1.0),
}
records = []
deadline = time.monotonic() + 90
gone = 0
while gone < int(gone_calls) and time.monotonic() < deadline:
    for name, call in calls.items():
        t0 = time.time()
        try:
            reply = call()
            role, epoch = getattr(reply, "role", ""), getattr(reply, "epoch", 0)
            rec = {"code": "OK", "detail": "", "role": role, "epoch": epoch}
        except grpc.RpcError as e:
            rec = {"code": e.code().name, "detail": e.details() or "", "role": "", "epoch": 0}
        rec.update(call=name, t0=t0, t1=time.time())
        records.append(rec)
        refused = rec["code"] == "UNAVAILABLE" and "does not lead" in rec["detail"]
        gone = gone + 1 if rec["code"] in ("UNAVAILABLE", "CANCELLED") and not refused else 0
    time.sleep(0.01)
channel.close()
with open(out, "w") as f:
    json.dump({"etcd": etcd, "records": records}, f)
"""


def teardown_network() -> None:
    """Delete NS_A (SIGKILLing whatever still runs in it, which removes its veth end) and a veth end left
    behind."""
    clear_namespace(NS_A)
    for dev in (VETH_B, VETH_A):
        if run(["ip", "link", "show", dev], check=False).returncode == 0:
            run(["ip", "link", "del", dev], check=False)


@contextlib.contextmanager
def partition_network() -> Iterator[None]:
    """NS_A joined to the root namespace by the veth pair (IP_A in NS_A, IP_B here); all of it is gone
    afterwards."""
    reason = missing_prerequisites(["ip"], "apt-get install iproute2")
    if reason:
        unavailable(reason)
    steps = [
        ["ip", "netns", "add", NS_A],
        in_ns(NS_A, "true"),  # `ip netns exec` must be able to remount /sys in a container
        ["ip", "link", "add", VETH_B, "type", "veth", "peer", "name", VETH_A],
        ["ip", "link", "set", VETH_A, "netns", NS_A],
        in_ns(NS_A, "ip", "addr", "add", f"{IP_A}/{PREFIX}", "dev", VETH_A),
        ["ip", "addr", "add", f"{IP_B}/{PREFIX}", "dev", VETH_B],
        in_ns(NS_A, "ip", "link", "set", "lo", "up"),
        in_ns(NS_A, "ip", "link", "set", VETH_A, "up"),
        ["ip", "link", "set", VETH_B, "up"],
    ]
    try:
        for cmd in steps:
            r = run(cmd, check=False)
            if r.returncode != 0:
                # Inside the try: the finally below removes what the earlier steps created.
                unavailable(
                    f"network namespace setup failed (needs root / CAP_NET_ADMIN and namespaces "
                    f"allowed): `{' '.join(cmd)}` exited {r.returncode}: {(r.stderr or r.stdout).strip()}"
                )
        yield
    finally:
        teardown_network()


class PartitionJob(ReplicatedJob):
    """One shard: ``pserver0`` at IP_A inside NS_A, ``replica0`` at IP_B here; two trainers here."""

    def __init__(self, tmp_path, etcd_url: str, args):
        super().__init__(tmp_path, etcd_url, n_pservers=1, n_trainers=2, args=args)
        self.endpoints = [f"{IP_A}:{free_ports(1)[0]}"]  # NS_A is empty: any port is free there
        self.backups = [f"{IP_B}:{free_ports(1, IP_B)[0]}"]

    def env(self, role: str, index: int, endpoints=None) -> dict:
        return without_proxies(super().env(role, index, endpoints))

    def start(self, role: str, index: int, tag: str = "") -> subprocess.Popen:
        """As :meth:`Job.start`, with ``pserverK`` run inside NS_A (``ip netns exec`` execs it: same pid)."""
        if role != "PSERVER":
            return super().start(role, index, tag)
        name = f"pserver{index}{tag}"
        n = sum(k.rsplit(".", 1)[0] == name for k in self.logs)
        path = str(self.tmp / f"{name}.{n}.log")
        with open(path, "wb") as log:
            proc = subprocess.Popen(
                in_ns(NS_A, sys.executable, SCRIPT, *self.args),
                env=self.env(role, index),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name], self.logs[f"{name}.{n}"] = proc, path
        self.waited.discard(name)
        return proc


def layout_digest(pservers: str) -> str:
    """The digest the job's trainers say Hello with (recovery_job's program in float64, its plan, sync,
    2 trainers)."""
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    t = DistributeTranspiler(DistributeTranspilerConfig())
    t.transpile(
        0,
        program=recovery_job.build_program(dtype=torch.float64),
        pservers=pservers,
        trainers=recovery_job.TRAINERS,
        sync_mode=True,
    )
    return t.get_trainer_program().layout_digest


def stamp(text: str) -> float:
    """A log line's time (recovery_job's ``%(asctime)s``: local time, milliseconds truncated) as epoch
    seconds."""
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


class LeadSampler:
    """Asks both processes ``Lead`` from the root namespace, concurrently, every ~50 ms, until stopped."""

    def __init__(self, job: PartitionJob):
        self.job = job
        self.samples: List[Dict[str, Tuple[float, float, Optional[Tuple[str, int]]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="lead-sampler")

    def _ask(self, name: str) -> Tuple[float, float, Optional[Tuple[str, int]]]:
        t0 = time.time()
        reply = self.job.lead(name, timeout=0.5)
        return t0, time.time(), None if reply is None else (reply.role, reply.epoch)

    def _run(self) -> None:
        with futures.ThreadPoolExecutor(2) as pool:
            while not self._stop.is_set():
                asked = {n: pool.submit(self._ask, n) for n in ("pserver0", "replica0")}
                self.samples.append({n: f.result() for n, f in asked.items()})
                self._stop.wait(0.05)

    def start(self) -> "LeadSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def wait_for(predicate, deadline: float, what: str, job: PartitionJob):
    """Poll ``predicate`` every 20 ms until it returns something truthy (returned); fail at ``deadline``."""
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{job.all_logs()}")
        time.sleep(0.02)


def leading(job: PartitionJob, name: str):
    """Process ``name``'s Lead answer if it says it is the primary, else None (another role, or no answer)."""
    reply = job.lead(name)
    return reply if reply is not None and reply.role == "primary" else None


def classify(rec: dict) -> str:
    """A probe record's outcome: "ok" / "role R" (Lead), "not leading" (the replica's refusal), "gone" (no
    server), "timed out", or "refused: CODE" (another refusal)."""
    if rec["code"] == "OK":
        return f"role {rec['role']}" if rec["call"] == "Lead" else "ok"
    if rec["code"] == "UNAVAILABLE" and "does not lead shard 0" in rec["detail"]:
        return "not leading"
    if rec["code"] in ("UNAVAILABLE", "CANCELLED"):  # connection refused, reset or closed under the call
        return "gone"
    if rec["code"] == "DEADLINE_EXCEEDED":  # no answer within the probe's 1 s: not accepted either
        return "timed out"
    return f"refused: {rec['code']}"
