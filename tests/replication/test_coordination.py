"""The replicas' coordination layer (pserver/replication/coordination.py, etcd.py) against a real etcd.

One winner per campaign however many replicas race, epochs that only grow, the in-sync list
gating who may lead, a deposed primary unable to write, and leases that end when their holder
(or etcd) dies: these are the guarantees the hot-standby replicas rest on, and they are etcd's, so
they are checked against the real server (:mod:`harness.etcd`), never a fake.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from typing import List, Optional

import pytest

from harness.ports import free_ports
from pserver.replication.coordination import CoordinationError, InSync, Leader, may_campaign
from pserver.replication.etcd import EtcdCoordinator
from tests.helpers import paths
from tests.helpers.etcd import etcd_fixture  # noqa: F401 - the `etcd` fixture
from tests.helpers.polling import poll

pytestmark = pytest.mark.timeout(60)
processes = pytest.mark.processes  # the tests that start etcd (and a replica process)

REPO = paths.REPO
TTL = 1


@pytest.fixture
def coordinators(etcd):
    """Make EtcdCoordinators on ``etcd`` (prefix per test); each is resigned and closed at teardown."""
    made: List[EtcdCoordinator] = []
    prefix = f"/ps-test/{uuid.uuid4().hex[:8]}"

    def make(replica_id: Optional[str] = None, shard: int = 0, **kwargs) -> EtcdCoordinator:
        made.append(
            EtcdCoordinator(etcd.url, prefix, shard, replica_id or uuid.uuid4().hex[:12], ttl=TTL, **kwargs)
        )
        return made[-1]

    yield make
    for c in made:
        c.resign()
        c.close()


def _in_sync(replicas, epoch=1, lineage="L") -> InSync:
    return InSync(
        replicas=tuple(replicas),
        endpoints={r: f"h:{i}" for i, r in enumerate(replicas)},
        epoch=epoch,
        lineage=lineage,
        revision=3,
    )


@pytest.mark.parametrize(
    "in_sync, replica_id, force, expected",
    [
        (None, "a", False, True),  # a fresh shard: whoever comes first
        (None, "a", True, True),
        (_in_sync(["a", "b"]), "a", False, True),  # listed: holds every acknowledged update
        (_in_sync(["b"]), "a", False, False),  # not listed: may lack updates
        (_in_sync(["b"]), "a", True, True),  # forced: recovery from a checkpoint
        (_in_sync([]), "a", False, False),
    ],
)
def test_may_campaign(in_sync, replica_id, force, expected):
    assert may_campaign(in_sync, replica_id, force) is expected


def _primary_meta(coordinator: EtcdCoordinator) -> Optional[dict]:
    """The primary key's etcd metadata (create_revision, lease, ...), read behind the coordinator's back."""
    kvs = coordinator._gw.call("test read", lambda c: c.get(coordinator._primary_key, metadata=True))
    return kvs[0][1] if kvs else None


@processes
def test_one_of_two_wins_and_both_see_it(etcd, coordinators):
    a, b = coordinators("a"), coordinators("b")
    epoch = a.campaign("127.0.0.1:1001", "lin")
    assert epoch is not None
    assert b.campaign("127.0.0.1:1002", "lin") is None
    assert int(_primary_meta(a)["create_revision"]) == epoch
    for c in (a, b):
        assert c.leader() == Leader(endpoint="127.0.0.1:1001", replica_id="a", epoch=epoch)
    s = b.in_sync()
    assert (s.replicas, dict(s.endpoints), s.epoch, s.lineage) == (
        ("a",),
        {"a": "127.0.0.1:1001"},
        epoch,
        "lin",
    )
    assert s.revision > 0
    assert a.holds(epoch) and not b.holds(epoch) and not a.holds(epoch + 1)
    assert a.campaign("127.0.0.1:1001", "lin") == epoch  # the leader asking again: still its epoch


@processes
def test_concurrent_campaigns_one_winner_per_round(coordinators):
    n, rounds = 8, 20
    cs = [coordinators(f"r{i}") for i in range(n)]
    barrier = threading.Barrier(n)
    epochs: List[int] = []
    for round_ in range(rounds):
        results: List[Optional[int]] = [None] * n
        errors: List[BaseException] = []

        def run(i: int) -> None:
            try:
                barrier.wait(timeout=10)
                results[i] = cs[i].campaign(f"127.0.0.1:{2000 + i}", "lin")
            except BaseException as e:  # noqa: BLE001 - reported by the main thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=20)
        assert not errors, errors
        winners = [i for i, e in enumerate(results) if e is not None]
        assert len(winners) == 1, f"round {round_}: winners {winners}"
        w, epoch = winners[0], results[winners[0]]
        assert cs[0].leader() == Leader(f"127.0.0.1:{2000 + w}", f"r{w}", epoch)
        assert not epochs or epoch > epochs[-1], (epochs, epoch)
        epochs.append(epoch)
        # Everyone back in the list, so that everyone may campaign in the next round.
        assert cs[w].set_in_sync(epoch, {f"r{i}": f"127.0.0.1:{2000 + i}" for i in range(n)})
        cs[w].resign()
        assert not cs[w].holds(epoch)
        assert cs[0].leader() is None  # revoked: gone at once, no TTL to wait for


@processes
def test_in_sync_list_gates_the_campaign(coordinators):
    a, b, c = coordinators("a"), coordinators("b"), coordinators("c")
    e1 = a.campaign("h:a", "lin-1")
    assert e1 is not None and a.set_in_sync(e1, {"a": "h:a", "c": "h:c"})
    a.resign()
    assert b.leader() is None
    assert b.campaign("h:b", "lin-b") is None  # not listed
    e2 = c.campaign("h:c", "lin-c")  # listed: leads, keeps the lineage
    assert e2 is not None and e2 > e1
    s = c.in_sync()
    assert (s.replicas, s.epoch, s.lineage) == (("c",), e2, "lin-1")
    c.resign()
    assert b.campaign("h:b", "lin-b") is None
    e3 = b.campaign("h:b", "lin-b", force=True)  # forced: leads under its own lineage
    assert e3 is not None and e3 > e2
    s = b.in_sync()
    assert (s.replicas, dict(s.endpoints), s.epoch, s.lineage) == (("b",), {"b": "h:b"}, e3, "lin-b")


@processes
def test_a_deposed_primary_cannot_write_the_in_sync_list(coordinators):
    a, b = coordinators("a"), coordinators("b")
    e1 = a.campaign("h:a", "lin")
    assert a.set_in_sync(e1, {"a": "h:a", "b": "h:b"})
    # Revoked behind a's back (as if it expired), so that a still believes it leads.
    lease = a._lease
    a._gw.call("test revoke", lambda cl: cl.post(cl.get_url("/kv/lease/revoke"), json={"ID": lease}))
    e2 = b.campaign("h:b", "lin")
    assert e2 is not None and e2 > e1
    before = b.in_sync()
    assert a.set_in_sync(e1, {"a": "h:a"}) is False
    assert b.in_sync() == before
    assert b.set_in_sync(e2, {"a": "h:a", "b": "h:b"})


CHILD = """
import sys
from pserver.replication.etcd import EtcdCoordinator
c = EtcdCoordinator(sys.argv[1], sys.argv[2], 0, "child", ttl=int(sys.argv[3]))
print(c.campaign("127.0.0.1:9", "lin"), flush=True)
sys.stdin.read()
"""


@processes
def test_a_sigkilled_primarys_key_expires_with_its_lease(etcd, coordinators):
    b = coordinators("b")
    prefix = b._base.rsplit("/", 1)[0]
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, etcd.url, prefix, str(TTL)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = child.stdout.readline().strip()
        assert line.isdigit(), (line, child.stderr.read() if child.poll() is not None else "")
        e1 = int(line)
        assert b.leader() == Leader("127.0.0.1:9", "child", e1)
        child.kill()
        killed = time.monotonic()
        child.wait(timeout=10)
        poll(lambda: b.leader() is None, "the SIGKILLed primary's key expired", timeout=TTL + 5)
        gone = time.monotonic() - killed
        assert gone <= TTL + 1.5, f"the primary key outlived its holder by {gone:.2f}s (lease TTL {TTL}s)"
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        child.stdin.close()
        child.stdout.close()
        child.stderr.close()
    assert b.campaign("h:b", "lin", force=True) > e1  # "child" is the in-sync list: only a forced campaign


@processes
def test_holds_ends_and_on_lost_fires_once_when_etcd_dies(etcd, coordinators):
    lost: List[int] = []
    a = coordinators("a", on_lost=lost.append)
    epoch = a.campaign("h:a", "lin")
    # Several keep-alive periods pass with holds() true throughout.
    until = time.monotonic() + 2 * TTL
    while time.monotonic() < until:
        assert a.holds(epoch)
        time.sleep(0.05)
    etcd.kill()
    killed = time.monotonic()
    poll(lambda: not a.holds(epoch), "holds() false after etcd died", timeout=TTL + 2)
    assert time.monotonic() - killed <= TTL + 0.3
    poll(lambda: lost, "on_lost called", timeout=TTL + 2)
    a.close()  # joins the keep-alive thread: no later call can come
    assert lost == [epoch]
    assert not a.holds(epoch)


def test_bad_ttl_is_refused():
    with pytest.raises(ValueError, match="ttl"):
        EtcdCoordinator("http://127.0.0.1:2379", "/p", 0, "a", ttl=0)


def test_unreachable_etcd_is_a_coordination_error_naming_it():
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    c = EtcdCoordinator(url, "/p", 0, "a", timeout=1.0)
    try:
        started = time.monotonic()
        with pytest.raises(CoordinationError, match=f"read primary .*{re.escape(url)}"):
            c.leader()
        with pytest.raises(CoordinationError, match=re.escape(url)):
            c.campaign("h:a", "lin")
        assert time.monotonic() - started < 1.0
    finally:
        c.close()


def test_an_etcd_that_never_answers_times_out_naming_it():
    # Accepts connections (the kernel's backlog) but never answers: only the deadline ends the call.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        c = EtcdCoordinator(url, "/p", 0, "a", timeout=0.5)
        try:
            started = time.monotonic()
            with pytest.raises(CoordinationError, match=f"etcd at {re.escape(url)}: read primary"):
                c.leader()
            assert 0.4 < time.monotonic() - started < 0.5 + 0.5
        finally:
            c.close()


@processes
def test_the_next_endpoint_is_tried_when_one_refuses(etcd, coordinators):
    (port,) = free_ports(1)
    a = EtcdCoordinator(f"http://127.0.0.1:{port},{etcd.url}", "/failover", 0, "a", ttl=TTL)
    try:
        epoch = a.campaign("h:a", "lin")
        assert epoch is not None and a.leader() == Leader("h:a", "a", epoch)
        a.resign()
    finally:
        a.close()
