"""Hot standby across a network partition: an isolated primary is fenced and refuses pushes; no split brain.

Topology (two network namespaces, as tests/system/test_two_hosts.py sets them up)::

    namespace NS_A (made here)                root namespace
    pserver0: shard 0's first process  ==veth==  replica0 (its second process), etcd, trainers 0 and 1
    bound to IP_A:port only                      bound to IP_B (etcd's client URL too;
                                                 its peer URL on 127.0.0.1)

The job (tests/scripts/recovery_job.py, sync, one shard on two processes, two trainers) starts with
pserver0 leading; replica0 joins, and only once it is in sync do the trainers (started with pserver0,
waiting at step 0) train. After WARMUP_UPDATES replicated steps NS_A is cut off by taking its end
of the veth down (``ip netns exec NS_A ip link set VETH_A down``). That drops every packet between
the namespaces in both directions, and leaks none elsewhere: in NS_A the route to IP_B goes with the
link (sends fail with ENETUNREACH at once), and in the root namespace the route to IP_A stays (marked
``linkdown``), so packets for NS_A are dropped at the veth rather than sent out of the default route
(taking the root end down instead would remove that route, and the root namespace's default route
would carry them off the machine). Local addresses stay reachable on both sides: a probe run inside
NS_A still reaches pserver0, and replica0 and the trainers still reach etcd. The test checks the cut
holds both ways before relying on it.

What it asserts, each from real observations (polls with deadlines, no sleeps standing in for them):

1. pserver0 is fenced: its log says it lost the lead of shard 0 at the epoch it led at, within
   ``FENCED_DEADLINE`` (the lease TTL + 1 s) of the cut, and it exits on its own with status 1
   (``LostLead``) within ``EXIT_DEADLINE`` of the cut (the fence, then ``serve()``'s graceful stop, which
   can wait 5 s for the replication sender and gives the trainers' calls cut off in flight 5 s, then the
   interpreter's exit).
2. pserver0 refuses pushes: a probe inside NS_A calls it over and over from the cut on (Lead, a
   Hello for trainer 0 from a fresh incarnation with the job's real layout digest, and a PushPullOne for
   trainer 0). No Hello or push is ever accepted. Every call that started after pserver0 logged its
   fence is refused with UNAVAILABLE "does not lead shard 0 (fenced" -- the check every trainer call
   (Hello, PushPull, PushPullOne...) passes first, so no push can be applied there any more -- or finds the
   process gone (its server stopped); Lead then answers "fenced", never "primary". The probe's last
   calls find it gone. Before the fence the isolated primary still leads (its lease has not lapsed) and
   refuses them for other reasons: trainer 0 is live (ALREADY_EXISTS), the push has no session. And
   nothing it applied after the cut was acknowledged: it stopped at most one update (the one in flight
   at the cut) beyond the update replica0 took over at.
3. No split brain: pserver0's fence line precedes replica0's "leads shard 0 at epoch E2" line (both
   logs stamp the same host clock), with E2 greater than pserver0's epoch; Lead sampled from the root
   namespace during the whole failover never finds two primaries, and no "primary" answer the probe got
   from pserver0 inside NS_A ends after replica0 first answered "primary".
4. The job finishes as if nothing happened: trainers exit 0, their final model equals single-process
   training, and no log line tells of a roll-back.
5. Heal: with the link up again, pserver0 is started again (the same command, inside NS_A) and
   rejoins as replica0's backup, in sync (replica0's Stats), while the trainers still train.

Needs root (or CAP_NET_ADMIN + CAP_SYS_ADMIN), ``ip`` and ``etcd``; skipped otherwise, naming the
failing command, or failed under ``PS_REQUIRE_SYSTEM_TESTS=1`` (:mod:`tests.helpers.system`). The
namespace, the job, the probe and the Lead sampler are :mod:`tests.helpers.partition`'s.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Dict, Optional

import pytest

from harness.netns import in_ns, run, without_proxies
from tests.helpers.etcd import etcd_or_skip
from tests.helpers.partition import (
    FENCED_LINE,
    FOLLOWED_LINE,
    GONE_CALLS,
    IP_A,
    IP_B,
    LEADS_LINE,
    NS_A,
    PROBE,
    STOPPED_LINE,
    VETH_A,
    LeadSampler,
    PartitionJob,
    classify,
    layout_digest,
    leading,
    partition_network,
    stamp,
    wait_for,
)
from tests.scripts import recovery_job

pytestmark = pytest.mark.processes

EPOCHS = 20  # 400 steps of each trainer, >= 40 s at STEP_DELAY: the heal is over long before
STEP_DELAY = 0.1  # until PAUSE_DIR/calm (written after the heal); the rest runs at full speed
WARMUP_UPDATES = 20  # steps the shard applies (replicated) before the cut
LEASE_TTL = 1  # the job's lease: replica_lease_ttl's default (Job.env drops PS_REPLICA_LEASE_TTL)
FENCED_DEADLINE = (
    LEASE_TTL + 1.0
)  # the cut -> pserver0's fence (its lease's deadline: <= 0.75 s after the last
# keep-alive it sent, <= 0.25 s before the cut; then its 50 ms poll) The cut -> pserver0 exited: the fence;
# its stop, which may wait 5 s for its replication sender (blocked on the cut-off backup) and gives calls in
# flight (the trainers', cut off) 5 s of grace; the interpreter's exit.
EXIT_DEADLINE = LEASE_TTL + 5.0 + 5.0 + 9.0
FAILOVER_DEADLINE = 60.0  # the cut -> replica0 leads
START_DEADLINE = 120.0  # a process started -> it leads / is in sync (importing torch on a loaded machine)
TRAINERS_DEADLINE = 180.0


@pytest.fixture
def partition_net():
    """NS_A joined to the root namespace by the veth pair (IP_A in NS_A, IP_B here); all of it is gone
    afterwards."""
    with partition_network():
        yield


@pytest.mark.timeout(300, method="signal")  # SIGALRM: the finally blocks and the fixture's teardown still run
def test_isolated_primary_is_fenced_refuses_pushes_and_never_leads_beside_its_backup(partition_net, tmp_path):
    started = time.monotonic()
    etcd = etcd_or_skip(tmp_path, host=IP_B)
    job = PartitionJob(
        tmp_path,
        etcd.url,
        args=[
            "--epochs",
            str(EPOCHS),
            "--step_delay",
            str(STEP_DELAY),
            "--pause_at",
            "0",
            "--pause_every_trainer",
            *recovery_job.FLOAT64,
        ],
    )
    probe: Optional[subprocess.Popen] = None
    sampler: Optional[LeadSampler] = None
    timeline: Dict[str, float] = {}
    try:
        # -- pserver0 (in NS_A) leads; replica0 joins and is in sync; then the trainers train -------------
        # The trainers start with pserver0 and wait at step 0 (--pause_at 0) until replica0 is in sync: a
        # trainer that has not said Hello within heartbeat_timeout (30 s) of pserver0's start would be
        # dropped and join late, which a loaded machine's imports can take.
        job.start("PSERVER", 0)
        for i in range(2):
            job.start("TRAINER", i)
        first = wait_for(
            lambda: leading(job, "pserver0"), time.monotonic() + START_DEADLINE, "pserver0 to lead", job
        )
        epoch1 = first.epoch
        job.start("REPLICA", 0)
        assert job.wait_in_sync(0, timeout=START_DEADLINE) == ("pserver0", "replica0")
        for i in range(2):
            job.wait_file(f"reached-{i}", START_DEADLINE)
        (job.pause / "go").touch()
        job.wait_until(
            lambda: (lambda st: st is not None and st.step >= WARMUP_UPDATES)(job.stats("pserver0")),
            f"{WARMUP_UPDATES} updates on pserver0",
            START_DEADLINE,
        )
        stats = job.stats("pserver0")
        assert stats.replica.role == "primary" and stats.replica.backup_in_sync, stats.replica

        digest = layout_digest(job.endpoints[0])
        probe_out = tmp_path / "probe.json"
        etcd_host, etcd_port = etcd.url.rsplit("/", 1)[-1].rsplit(":", 1)
        with open(tmp_path / "probe.log", "wb") as log:
            probe = subprocess.Popen(
                in_ns(
                    NS_A,
                    sys.executable,
                    "-c",
                    PROBE,
                    job.endpoints[0],
                    etcd_host,
                    etcd_port,
                    digest,
                    str(job.pause),
                    str(probe_out),
                    str(GONE_CALLS),
                ),
                env=without_proxies(dict(os.environ)),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        job.wait_until(
            lambda: (job.pause / "probe-ready").exists() or probe.poll() is not None,
            "the probe",
            START_DEADLINE,
        )
        assert probe.poll() is None, (tmp_path / "probe.log").read_text()
        sampler = LeadSampler(job).start()
        wait_for(lambda: len(sampler.samples) >= 3, time.monotonic() + 10, "Lead samples", job)

        # -- the cut -------------------------------------------------------------------------------------
        r = run(in_ns(NS_A, "ip", "link", "set", VETH_A, "down"), check=False)
        assert r.returncode == 0, r.stderr
        cut = time.time()
        cut_mono = time.monotonic()
        (job.pause / "probe-go").touch()
        # The cut holds this way too: nothing here reaches pserver0's port (no answer, not even a refusal).
        with socket.socket() as s:
            s.settimeout(0.5)
            reached = s.connect_ex((IP_A, int(job.endpoints[0].rsplit(":", 1)[1])))
        assert reached not in (0, errno.ECONNREFUSED), (
            f"the root namespace reached {job.endpoints[0]} across the cut "
            f"({errno.errorcode.get(reached, reached)})"
        )

        # 1. pserver0 fences itself and exits on its own, non-zero (LostLead), within the deadline.
        old = job.procs["pserver0"]
        job.waited.add("pserver0")  # its exit is expected from now on
        deadline = cut_mono + EXIT_DEADLINE
        while old.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        timeline["pserver0 exited"] = time.monotonic() - cut_mono
        log0 = job.log("pserver0.0")
        assert old.returncode is not None, (
            f"pserver0 still runs {EXIT_DEADLINE}s after the cut:\n{log0[-3000:]}"
        )
        assert old.returncode == 1 and "LostLead" in log0, (old.returncode, log0[-3000:])
        fenced = FENCED_LINE.findall(log0)
        assert [(ep, int(e)) for _, ep, e in fenced] == [(job.endpoints[0], epoch1)], log0[-3000:]
        fenced_at = stamp(fenced[0][0])
        timeline["pserver0 fenced (log)"] = fenced_at - cut
        assert fenced_at - cut <= FENCED_DEADLINE, (
            f"pserver0 fenced itself {fenced_at - cut:.2f}s after the cut"
        )

        # 2. What the probe inside NS_A got from pserver0 since the cut (it ends once pserver0 is gone).
        try:
            assert probe.wait(30) == 0, (tmp_path / "probe.log").read_text()
        except subprocess.TimeoutExpired:
            pytest.fail(
                f"the probe still finds pserver0 answering 30 s after it exited:\n"
                f"{(tmp_path / 'probe.log').read_text()}"
            )
        found = json.loads(probe_out.read_text())
        assert found["etcd"].startswith("OSError errno=101"), (
            f"NS_A reached etcd across the cut: {found['etcd']}"
        )
        records = found["records"]
        outcomes = [(rec["call"], classify(rec)) for rec in records]
        assert records and records[0]["t0"] >= cut
        assert not [rec for rec in records if rec["call"] != "Lead" and rec["code"] == "OK"], (
            f"pserver0 accepted a Hello or a push after the cut: {records}"
        )
        # Its digest is right: a Hello a primary refuses is refused for the trainer id being live, not the
        # plan.
        assert not [rec for rec in records if "plan mismatch" in rec["detail"]], records[:6]
        after_fence = [(rec, o) for rec, (_, o) in zip(records, outcomes) if rec["t0"] >= fenced_at + 0.001]
        assert after_fence, "the probe made no call after pserver0's fence"
        allowed = {
            "Lead": {"role fenced", "gone", "timed out"},
            "Hello": {"not leading", "gone", "timed out"},
            "PushPullOne": {"not leading", "gone", "timed out"},
        }
        wrong = [(rec["call"], o, rec["detail"]) for rec, o in after_fence if o not in allowed[rec["call"]]]
        assert not wrong, f"pserver0 answered after its fence: {wrong[:10]}"
        last = outcomes[-GONE_CALLS:]
        assert len(last) == GONE_CALLS and {o for _, o in last} == {"gone"}, (
            f"pserver0 still answers: {records[-6:]}"
        )
        counts: Dict[str, int] = {}
        for call, o in outcomes:
            counts[f"{call}: {o}"] = counts.get(f"{call}: {o}", 0) + 1

        # 3. replica0 takes over at a higher epoch, after pserver0 stopped serving (same host clock).
        second = wait_for(
            lambda: leading(job, "replica0"), cut_mono + FAILOVER_DEADLINE, "replica0 to lead", job
        )
        epoch2 = second.epoch
        assert epoch2 > epoch1
        leads = [(stamp(t), ep, int(e), int(u)) for t, ep, e, u in LEADS_LINE.findall(job.log("replica0.0"))]
        assert [(ep, e) for _, ep, e, _ in leads] == [(job.backups[0], epoch2)], job.log("replica0.0")[-3000:]
        led_at, took_over_at = leads[0][0], leads[0][3]
        timeline["replica0 leads (log)"] = led_at - cut
        assert fenced_at < led_at, f"replica0 led at {led_at} before pserver0 was fenced at {fenced_at}"
        # Nothing pserver0 applied after the cut was acknowledged: in sync mode a step's update is answered
        # only once the backup holds it, and the next step needs that answer, so the isolated primary stopped
        # at most one update (the one in flight at the cut, never acknowledged) beyond what replica0 took over
        # with.
        stopped = [int(u) for u in STOPPED_LINE.findall(log0)]
        assert len(stopped) == 1 and stopped[0] <= took_over_at + 1, (stopped, took_over_at)

        # -- heal: the link up again; pserver0 started again in NS_A rejoins as the backup ----------------
        r = run(in_ns(NS_A, "ip", "link", "set", VETH_A, "up"), check=False)
        assert r.returncode == 0, r.stderr
        healed = time.monotonic()
        job.restart("pserver0")
        assert job.wait_in_sync(0, timeout=START_DEADLINE) == ("replica0", "pserver0")
        timeline["pserver0 back in sync (after the heal)"] = time.monotonic() - healed
        stats = job.stats("replica0")
        assert (
            stats.replica.role,
            stats.replica.epoch,
            stats.replica.backup,
            stats.replica.backup_in_sync,
        ) == ("primary", epoch2, job.endpoints[0], True), stats.replica
        running = {f"trainer{i}": job.procs[f"trainer{i}"].poll() for i in range(2)}
        assert running == {"trainer0": None, "trainer1": None}, (
            f"the trainers finished before the heal: {running}"
        )
        sampler.stop()
        (job.pause / "calm").touch()

        # The samples from the root namespace, and the probe's Lead answers from inside NS_A: never two
        # primaries.
        both = [
            s
            for s in sampler.samples
            if sum(a is not None and a[0] == "primary" for _, _, a in s.values()) > 1
        ]
        assert not both, f"two primaries answered at once: {both[:3]}"
        new_primary = [
            t0
            for s in sampler.samples
            for name, (t0, _, a) in s.items()
            if name == "replica0" and a == ("primary", epoch2)
        ]
        assert new_primary, "the root namespace never saw replica0 lead"
        old_primary = [rec["t1"] for rec in records if rec["call"] == "Lead" and rec["role"] == "primary"]
        assert not old_primary or max(old_primary) < min(new_primary), (
            f"pserver0 answered 'primary' in NS_A until {max(old_primary)}, after replica0 answered "
            "'primary' "
            f"here at {min(new_primary)}"
        )

        # 4. The job finishes: exit 0, the model of one process, no roll-back.
        job.wait_trainers(TRAINERS_DEADLINE)
        job.assert_trained_as_one_process(epochs=EPOCHS)
        assert job.rollback_lines() == []
        codes = job.finish_pservers()
        assert codes == {"pserver0": 0, "replica0": 0}, (codes, job.all_logs())

        followed = [
            (stamp(t) - cut, int(tid), addr)
            for k in ("trainer0.0", "trainer1.0")
            for t, tid, addr, e in FOLLOWED_LINE.findall(job.log(k))
            if int(e) == epoch2
        ]
        for at, tid, addr in followed:
            timeline[f"trainer {tid} follows {addr}"] = at
        timeline["total"] = time.monotonic() - started
        print(
            f"\nepochs {epoch1} -> {epoch2}; pserver0 stopped after {stopped[0]} updates, replica0 took over "
            "at "
            f"{took_over_at}; probe outcomes {counts}; {len(sampler.samples)} Lead samples"
        )
        print(
            "timeline (s after the cut, unless noted): "
            + ", ".join(f"{k} {v:.2f}" for k, v in timeline.items())
        )
    finally:
        if sampler is not None:
            sampler.stop()
        if probe is not None and probe.poll() is None:
            os.killpg(probe.pid, signal.SIGKILL)
            probe.wait(10)
        job.close()
        etcd.stop()
