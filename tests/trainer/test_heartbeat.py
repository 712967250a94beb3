"""The heartbeat thread's decisions: which pservers get a heartbeat now, and when it looks again (tables);
and the thread itself against real gRPC servers: one heartbeat in flight per pserver, none delayed by another,
and no thread started per heartbeat.
"""

import dataclasses
import math
import threading
import time

import numpy as np
import pytest

from trainer.heartbeat import CHECKS_PER_INTERVAL, heartbeats_due, next_check

NEVER = -math.inf  # a pserver this trainer never reached
INTERVAL = 2.0  # heartbeat_interval

# (case, last contact per pserver, now, expected pservers to heartbeat)
DUE = [
    ("steady training: every pserver reached within the interval", {"a": 99.5, "b": 99.9}, 100.0, []),
    ("one pserver silent for exactly an interval", {"a": 98.0, "b": 99.9}, 100.0, ["a"]),
    ("one pserver silent for more than an interval", {"a": 97.0, "b": 99.9}, 100.0, ["a"]),
    ("idle towards every pserver (a data stall)", {"a": 97.0, "b": 90.0}, 100.0, ["a", "b"]),
    ("a push parked in a barrier since 98.5: it started 1.5 s ago, not yet due", {"a": 98.5}, 100.0, []),
    ("the same push parked since 97.9: its start is older than an interval", {"a": 97.9}, 100.0, ["a"]),
    (
        "a pserver never reached (a node's leader: another local rank's pserver)",
        {"a": 99.9, "b": NEVER},
        100.0,
        ["b"],
    ),
    ("no pservers", {}, 100.0, []),
]


@pytest.mark.parametrize("case, contacts, now, expected", DUE, ids=[c[0] for c in DUE])
def test_heartbeats_due(case, contacts, now, expected):
    assert heartbeats_due(contacts, now, INTERVAL) == expected


FLOOR = INTERVAL / CHECKS_PER_INTERVAL
# (case, last contact per pserver after this round's heartbeats, now, expected seconds to the next look)
NEXT = [
    ("the earliest falls due in 1.5 s", {"a": 99.5, "b": 99.9}, 100.0, 1.5),
    ("every pserver just reached: a whole interval", {"a": 100.0, "b": 100.0}, 100.0, INTERVAL),
    ("one falls due in a moment: no sooner than the floor", {"a": 98.01, "b": 100.0}, 100.0, FLOOR),
    ("one already due (its heartbeat failed: the thread's try counts): the floor", {"a": 97.0}, 100.0, FLOOR),
    ("no pservers: an interval", {}, 100.0, INTERVAL),
    (
        "a contact from the future (clock read before a call noted it): at most an interval",
        {"a": 101.0},
        100.0,
        INTERVAL,
    ),
]


@pytest.mark.parametrize("case, contacts, now, expected", NEXT, ids=[c[0] for c in NEXT])
def test_next_check(case, contacts, now, expected):
    assert next_check(contacts, now, INTERVAL) == pytest.approx(expected)


# -- the thread against real gRPC servers ------------------------------------------------------------


class FakePserver:
    """A gRPC server that answers only Heartbeat, counting them; while ``held`` is clear it holds each one."""

    def __init__(self):
        from concurrent import futures

        import grpc

        from psproto import ps_pb2
        from psproto.wire import method_path

        self.arrived = []  # monotonic time of each heartbeat's arrival
        self.held = threading.Event()
        self.held.set()
        self._lock = threading.Lock()

        def heartbeat(request, context):
            with self._lock:
                self.arrived.append(time.monotonic())
            self.held.wait(30)
            return ps_pb2.HeartbeatReply()

        service, method = method_path("Heartbeat").strip("/").split("/")
        handler = grpc.method_handlers_generic_handler(
            service,
            {
                method: grpc.unary_unary_rpc_method_handler(
                    heartbeat,
                    request_deserializer=ps_pb2.HeartbeatRequest.FromString,
                    response_serializer=ps_pb2.HeartbeatReply.SerializeToString,
                )
            },
        )
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), handlers=(handler,))
        self.endpoint = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def count(self) -> int:
        with self._lock:
            return len(self.arrived)

    def stop(self) -> None:
        self.held.set()
        self.server.stop(0)


def test_a_pserver_that_takes_no_call_up_gets_one_heartbeat_and_delays_no_other_pserver_s():
    from harness.models import odd_program
    from trainer.heartbeat import Heartbeat
    from trainer.transport import Channels
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    stalled, healthy = FakePserver(), FakePserver()
    interval, deadline = 0.2, 30.0
    t = DistributeTranspiler(
        DistributeTranspilerConfig(heartbeat_interval=interval, heartbeat_timeout=deadline)
    )
    t.transpile(0, program=odd_program(), pservers=f"{stalled.endpoint},{healthy.endpoint}", trainers=1)
    channels = Channels(t.get_trainer_program())
    stalled.held.clear()  # its handler holds every heartbeat: a pserver whose loop takes nothing up
    beat = Heartbeat(channels, [stalled.endpoint, healthy.endpoint], interval, deadline).start()
    try:
        start = time.monotonic()
        # Over ten intervals the healthy pserver is heartbeaten about once an interval, on time...
        wait_until(lambda: healthy.count() >= 8, 10.0, "the healthy pserver's heartbeats")
        elapsed = time.monotonic() - start
        gaps = np.diff(healthy.arrived)
        assert gaps.max() < interval * (1 + 1 / CHECKS_PER_INTERVAL) + 0.5, gaps
        # ... while the stalled one, its first heartbeat still in flight, got no second one.
        assert stalled.count() == 1 and elapsed >= 7 * interval
        assert channels[stalled.endpoint].contact.last(time.monotonic()) == pytest.approx(
            time.monotonic(), abs=0.1
        )
        stalled.held.set()  # it answers: heartbeats to it go on once an interval
        wait_until(lambda: stalled.count() >= 3, 10.0, "the released pserver's next heartbeats")
    finally:
        beat.stop()
        channels.shutdown()
        stalled.stop()
        healthy.stop()


def test_heartbeats_of_many_idle_trainers_start_no_thread_per_heartbeat(monkeypatch):
    """The emulated fan-in's case: one thread heartbeats many idle trainers' channels, each its own
    connection.

    A gRPC future on an idle channel starts a thread to poll it, so each heartbeat did: hundreds of such
    starts an interval in a crowded process left the heartbeats late and the pservers dropped trainers.
    """
    from harness.models import odd_program
    from trainer.heartbeat import Heartbeat
    from trainer.transport import Channels
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    pserver = FakePserver()
    interval, trainers = 0.1, 8
    t = DistributeTranspiler(DistributeTranspilerConfig(heartbeat_interval=interval, heartbeat_timeout=30.0))
    t.transpile(0, program=odd_program(), pservers=pserver.endpoint, trainers=trainers)
    channels = [Channels(dataclasses.replace(t.get_trainer_program(), trainer_id=k)) for k in range(trainers)]
    started_by_heartbeat = []
    thread_start = threading.Thread.start

    def counted_start(thread):
        if "heartbeat" in threading.current_thread().name:
            started_by_heartbeat.append(thread.name)
        return thread_start(thread)

    monkeypatch.setattr(threading.Thread, "start", counted_start)
    beat = Heartbeat(channels, [pserver.endpoint], interval, 30.0).start()
    try:
        wait_until(lambda: pserver.count() >= 10 * trainers, 20.0, "ten intervals of heartbeats")
    finally:
        beat.stop()
        for c in channels:
            c.shutdown()
        pserver.stop()
    # Each trainer's call threads (two per pserver) start once; the heartbeats reuse them.
    assert len(started_by_heartbeat) <= 2 * trainers, started_by_heartbeat
    assert all(name.startswith("trainer-comm") for name in started_by_heartbeat), started_by_heartbeat


def test_a_heartbeat_that_waited_for_a_call_thread_is_reported(caplog):
    """Late heartbeats are what drop live trainers: the process says so, before any pserver does."""
    from harness.models import odd_program
    from trainer.heartbeat import Heartbeat
    from trainer.transport import Channels
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig

    pserver = FakePserver()
    interval = 0.1
    t = DistributeTranspiler(DistributeTranspilerConfig(heartbeat_interval=interval, heartbeat_timeout=30.0))
    t.transpile(0, program=odd_program(), pservers=pserver.endpoint, trainers=1)
    channels = Channels(t.get_trainer_program())
    # Reached once (as by its Hello): its heartbeat falls due an interval later. (One never reached has no
    # due time to be late against: a trainer that adopts a layout heartbeats it from before its Hello.)
    channels[pserver.endpoint].contact.noted(time.monotonic())
    busy = threading.Event()
    held = [channels.submit(lambda: busy.wait(30)) for _ in range(2)]  # both of its call threads
    beat = Heartbeat(channels, [pserver.endpoint], interval, 30.0).start()
    try:
        time.sleep(5 * interval)  # the heartbeat due after an interval waits for a call thread for four more
        assert pserver.count() == 0
        busy.set()
        wait_until(lambda: pserver.count() >= 1, 10.0, "the heartbeat, once a call thread is free")
        wait_until(lambda: any("late" in r.getMessage() for r in caplog.records), 10.0, "the warning")
    finally:
        busy.set()
        beat.stop()
        channels.shutdown()
        pserver.stop()
    assert all(f.result(0) for f in held)
    warning = next(r for r in caplog.records if "late" in r.getMessage())
    assert (
        warning.levelname == "WARNING"
        and "1 heartbeat(s) went out more than heartbeat_interval" in warning.getMessage()
    )


def wait_until(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
