"""Hot standby's decisions, table-tested without processes: roles, whom trainers follow, the outbox's
acknowledgements, the replica settings."""

from __future__ import annotations

import threading
import time
from collections import namedtuple
from types import SimpleNamespace

import pytest
import torch

from pserver.errors import NotPrimary
from pserver.replication.backup import ReplicaUnreachable, Transport
from pserver.replication.outbox import Outbox
from pserver.replication.roles import (
    BACKUP,
    CAMPAIGN,
    JOIN,
    JOINING,
    PRIMARY,
    RECOVER,
    REJOIN,
    STAY,
    WAIT,
    next_step,
)
from trainer.transport.primaries import MOVED_ON, choose_primary
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program
from transpiler.roles.replicas import resolve_replicas

Leader = namedtuple("Leader", "endpoint replica_id epoch")
InSync = namedtuple("InSync", "replicas")

ME, OTHER = "me", "other"


@pytest.mark.parametrize(
    "role, leader, in_sync, following, was_in_sync, waited, expected",
    [
        # no primary: who may campaign
        (JOINING, None, None, 0, False, 0.0, CAMPAIGN),  # a fresh shard
        (BACKUP, None, InSync((ME, OTHER)), 5, True, 0.0, CAMPAIGN),  # the in-sync backup of a dead primary
        (JOINING, None, InSync((OTHER,)), 0, False, 1.0, WAIT),  # a restart: the in-sync one may come back
        (JOINING, None, InSync((OTHER,)), 0, False, 30.0, RECOVER),  # it did not: lead from the checkpoint
        (BACKUP, None, InSync((OTHER,)), 5, False, 29.9, WAIT),  # a catching-up backup is no in-sync one
        # a primary exists
        (JOINING, Leader("a", OTHER, 5), InSync((OTHER,)), 0, False, 0.0, JOIN),
        (BACKUP, Leader("a", OTHER, 5), InSync((OTHER,)), 5, False, 0.0, STAY),  # catching up
        (BACKUP, Leader("a", OTHER, 5), InSync((OTHER, ME)), 5, True, 0.0, STAY),  # in sync
        (BACKUP, Leader("a", OTHER, 5), InSync((OTHER,)), 5, True, 0.0, REJOIN),  # dropped by its primary
        (BACKUP, Leader("a", OTHER, 9), InSync((OTHER,)), 5, True, 0.0, REJOIN),  # a new primary
        (PRIMARY, Leader("a", ME, 5), InSync((ME,)), 0, False, 0.0, STAY),
    ],
)
def test_next_step(role, leader, in_sync, following, was_in_sync, waited, expected):
    assert next_step(role, leader, in_sync, ME, following, was_in_sync, waited, 30.0) == expected


@pytest.mark.parametrize(
    "answers, known, expected",
    [
        ({"a": None, "b": ("backup", 0)}, 3, None),  # the primary died; its lease has not lapsed
        ({"a": None, "b": ("primary", 7)}, 3, "b"),  # the backup leads now
        ({"a": ("fenced", 3), "b": ("primary", 7)}, 3, "b"),
        (
            {"a": ("primary", 3), "b": ("primary", 7)},
            3,
            "b",
        ),  # an old primary not fenced yet: the later epoch
        ({"a": ("primary", 3), "b": ("joining", 0)}, 3, "a"),  # a transient failure: the same primary
        ({"a": ("primary", 2), "b": None}, 3, None),  # older than one already followed: never
        # A process of a later layout (the job changed its pserver count): its Hello says where to go.
        ({"a": None, "b": (MOVED_ON, 0)}, 3, "b"),
        ({"a": ("primary", 7), "b": (MOVED_ON, 9)}, 3, "b"),
    ],
)
def test_choose_primary(answers, known, expected):
    assert choose_primary(answers, known) == expected


class FakeBackup(Transport):
    """A backup that takes every message (or fails once ``down``), recording their seqs."""

    def __init__(self):
        self.down = False
        self.seqs = []
        self.sent = threading.Event()

    def send(self, endpoint, messages, timeout):
        from psproto import ps_pb2
        from psproto.codec import decode_chunk

        if self.down:
            raise ReplicaUnreachable(f"{endpoint}: UNAVAILABLE")
        header, _ = decode_chunk(messages[0], ps_pb2.ReplicaHeader)
        self.seqs.append(header.seq)
        self.sent.set()
        return header.seq


def outbox(transport, etcd):
    def set_in_sync(replicas):
        etcd.append(sorted(replicas.values()))
        return True

    return Outbox(("p", "127.0.0.1:1"), 4, transport, set_in_sync, 1 << 20, timeout=5.0)


def record(box, n=1):
    for _ in range(n):
        box.record(0, box.seq + 1, {"trainers": {}, "closed": []}, {"w": torch.ones(3)}, {})


def wait_in_sync(box, timeout=5.0):
    with box.cv:
        assert box.cv.wait_for(lambda: box.backup is not None and box.backup.in_sync, timeout)


def test_outbox_without_a_backup_acknowledges_at_once():
    box = outbox(FakeBackup(), [])
    try:
        record(box, 3)
        box.wait_acked()  # returns: nothing to wait for
        assert box.acked == 3
    finally:
        box.stop()


def test_outbox_counts_a_backup_in_only_once_it_holds_everything_then_waits_for_it():
    backup, etcd = FakeBackup(), []
    box = outbox(backup, etcd)
    try:
        record(box, 2)
        assert box.attach("b", "127.0.0.1:2") == 2  # the snapshot stands at message 2
        record(box, 3)  # 3, 4, 5: queued while the backup loads
        box.wait_acked()  # not counted yet: nothing to wait for
        assert backup.seqs == [] and etcd == []
        box.follow("b")
        wait_in_sync(box)  # sent 3, 4, 5; then into etcd's list
        assert backup.seqs == [3, 4, 5] and etcd == [["127.0.0.1:1", "127.0.0.1:2"]]
        record(box, 1)
        box.wait_acked()  # counted: returns once the backup holds 6
        assert backup.seqs == [3, 4, 5, 6]
    finally:
        box.stop()


def test_outbox_drops_a_failed_backup_from_etcd_before_acknowledging_alone():
    backup, etcd = FakeBackup(), []
    box = outbox(backup, etcd)
    try:
        box.attach("b", "127.0.0.1:2")
        box.follow("b")
        wait_in_sync(box)
        backup.down = True
        record(box, 1)
        box.wait_acked()  # the send fails: dropped, then acknowledged alone
        assert box.backup is None and etcd[-1] == ["127.0.0.1:1"]
    finally:
        box.stop()


def test_outbox_fenced_by_etcd_refuses_to_acknowledge():
    backup = FakeBackup()
    box = Outbox(("p", "127.0.0.1:1"), 4, backup, lambda replicas: len(replicas) > 1, 1 << 20, timeout=5.0)
    try:
        box.attach("b", "127.0.0.1:2")
        box.follow("b")
        wait_in_sync(box)
        backup.down = True  # and etcd says another process leads now
        record(box, 1)
        with pytest.raises(NotPrimary, match="lost the lead"):
            box.wait_acked()
    finally:
        box.stop()


def program():
    return Program(torch.nn.Linear(100, 100), optimizer="sgd", lr=0.1)


def test_replicas_from_the_environment_and_each_endpoint_serving_its_shard():
    env = {
        "PS_SERVER_REPLICAS": "2",
        "PS_REPLICA_ENDPOINTS": "127.0.0.1:2,127.0.0.1:4",
        "PS_COORDINATOR": "http://127.0.0.1:2379",
    }
    t = DistributeTranspiler(
        resolve_replicas(DistributeTranspilerConfig(), ["127.0.0.1:1", "127.0.0.1:3"], env)
    )
    t.transpile(0, program=program(), pservers="127.0.0.1:1,127.0.0.1:3")
    assert t.get_trainer_program().replica_groups == {
        "127.0.0.1:1": ["127.0.0.1:1", "127.0.0.1:2"],
        "127.0.0.1:3": ["127.0.0.1:3", "127.0.0.1:4"],
    }
    for ep, shard in (("127.0.0.1:1", 0), ("127.0.0.1:2", 0), ("127.0.0.1:3", 1), ("127.0.0.1:4", 1)):
        prog = t.get_pserver_program(ep)
        assert prog.shard == shard and prog.endpoint == ep
        assert [b.name for b in prog.blocks] == [
            b.name for b in t.get_pserver_program(prog.pservers[shard]).blocks
        ]
        assert set(t.get_startup_program(ep, prog).tensors) == {b.name for b in prog.blocks}


@pytest.mark.parametrize(
    "fields, env, message",
    [
        ({"server_replicas": 3}, {}, "server_replicas must be 1"),
        ({"server_replicas": 2, "coordinator": "http://x:1"}, {}, "needs replica_endpoints"),
        ({"server_replicas": 2, "replica_endpoints": "127.0.0.1:2"}, {}, "lists 1 endpoints for 2"),
        (
            {
                "server_replicas": 2,
                "replica_endpoints": "127.0.0.1:2,127.0.0.1:1",
                "coordinator": "http://x:1",
            },
            {},
            "more than once",
        ),
        ({"server_replicas": 2, "replica_endpoints": "127.0.0.1:2,127.0.0.1:4"}, {}, "needs a coordinator"),
        ({}, {"PS_SERVER_REPLICAS": "two"}, "not a replica count"),
        ({"replica_lease_ttl": 0.5}, {}, "whole number of seconds"),
        ({"replica_digest_every": -1}, {}, "replica_digest_every"),
    ],
)
def test_bad_replica_settings_are_refused_naming_the_field(fields, env, message):
    with pytest.raises(ValueError, match=message):
        resolve_replicas(DistributeTranspilerConfig(**fields), ["127.0.0.1:1", "127.0.0.1:3"], env)


def test_primaries_follow_the_new_primary_and_resend_once_per_failover():
    """A call that finds its shard's primary gone asks both processes, says Hello to the one that leads
    (with the caller's join_at), and is sent again there; a call failing on the old generation after
    another already followed does not follow twice."""
    from trainer.errors import DOWN, PserverError
    from trainer.transport.primaries import ShardPrimary

    answers = {"a": ("primary", 3), "b": ("backup", 0)}
    connected, hellos, sent = [], [], []

    class Shard:  # the calls a shard's primary is followed with (primaries.ShardCalls), scripted
        endpoint = "a"

        def connect(self, address):
            connected.append(address)

        def lead(self, address, timeout):
            return answers[address]

        def hello_here(self, deadline, join_at):
            hellos.append(join_at)
            return SimpleNamespace(replica_epoch=answers[primary.address][1])

    primary = ShardPrimary(Shard(), ["a", "b"], trainer_id=0, timeout=5.0)
    primary.follow(0, time.monotonic() + 5, join_at=7)
    assert (primary.address, primary.epoch, hellos, connected) == ("a", 3, [7], [])

    def attempt():
        sent.append(primary.address)
        if primary.address == "a":
            raise PserverError("a", "UNAVAILABLE: gone", DOWN)
        return "answered"

    answers.update(a=None, b=("primary", 9))  # a died; b leads at a later epoch
    assert primary.run(attempt) == "answered"
    assert sent == ["a", "b"] and connected == ["b"] and primary.epoch == 9 and primary.failovers == 1
    before = primary.generation
    primary.follow(before - 1, time.monotonic() + 5)  # a stale failure: already followed
    assert primary.generation == before and len(hellos) == 2
    alone = ShardPrimary(Shard(), ["z"], trainer_id=0, timeout=5.0)
    assert alone.run(lambda: "plain") == "plain" and not alone.replicated
