"""Sessions in real processes: one process per trainer id, stray messages, a fenced old process.

Each role is its own process (tests/scripts/recovery_job.py, heartbeat_interval 0.5 s, so a
session stays alive 1.5 s after its last call). One job serves both tests (starting four
processes that import torch is most of what a job costs): trainer 1 pauses before step 10 (a
file handshake) while trainer 0 waits in the barrier; stray Closes and a second process for the
live trainer 0 arrive; then trainer 1's process is paused (SIGSTOP) and a new one replaces it.
The job must still end with the model of single-process PyTorch.
"""

from __future__ import annotations

import signal
import time
from types import SimpleNamespace

import grpc
import pytest

from psproto import ps_pb2
from tests.helpers.jobs import Job
from tests.helpers.launch import wait_for
from tests.scripts import recovery_job
from transpiler import DistributeTranspilerConfig

CLOSE = "/psproto.ParameterServer/Close"
# What a port scanner or a client pointed at the wrong port sends: parsed as "trainer N closes".
STRAYS = [
    b"",
    ps_pb2.CloseRequest(trainer_id=1).SerializeToString(),
    ps_pb2.CloseRequest(trainer_id=0, session="0123456789abcdef" * 2).SerializeToString(),
]


def send_strays(endpoint: str) -> SimpleNamespace:
    """Each stray Close to ``endpoint`` (its RpcError, or None if it was accepted), then the pserver's
    Stats."""
    errors = []
    with grpc.insecure_channel(endpoint) as channel:
        close = channel.unary_unary(CLOSE)
        for message in STRAYS:
            try:
                close(message, timeout=10)
                errors.append(None)
            except grpc.RpcError as e:
                errors.append(e)
        stats = ps_pb2.StatsReply.FromString(
            channel.unary_unary("/psproto.ParameterServer/Stats")(b"", timeout=10)
        )
    return SimpleNamespace(errors=errors, stats=stats)


# The job's session settings: recovery_job.py's heartbeat interval (passed to it explicitly) and its
# connect_timeout, how long a trainer's Hello waits for a pserver.
HEARTBEAT_INTERVAL = 0.5
CONNECT_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The shared job, run to its end; ``job.seen`` holds what the tests check from its middle."""
    job = Job(
        tmp_path_factory.mktemp("fencing"),
        args=[
            "--pause_at",
            "10",
            "--pause_trainer",
            "1",
            "--heartbeat_interval",
            str(HEARTBEAT_INTERVAL),
            *recovery_job.FLOAT64,
        ],
    )
    job.seen = SimpleNamespace()
    try:
        job.start_all()
        job.wait_file("reached")  # trainer 1 is about to train step 10; trainer 0 waits in the barrier
        job.seen.strays = [send_strays(endpoint) for endpoint in job.endpoints]

        # A second process started as trainer 0 (a launcher typo) while trainer 0 lives. Timed from its
        # first Hello (it logs "waiting for" just before), not from its start: starting python and torch
        # takes what the machine's load makes it take.
        dup = job.start("TRAINER", 0, tag="-dup")
        wait_for(
            lambda: "trainer 0: waiting for" in job.log("trainer0-dup.0") or dup.poll() is not None,
            60,
            "the second trainer 0 to say Hello",
        )
        hello_at = time.monotonic()
        job.seen.dup_code = job.wait("trainer0-dup", 60)
        job.seen.dup_seconds = time.monotonic() - hello_at

        # Trainer 1's VM pauses (no heartbeat, no call) and it is restarted elsewhere meanwhile.
        job.send_signal("trainer1", signal.SIGSTOP)
        job.start("TRAINER", 1, tag="-new")
        job.wait_until(lambda: "ready at step 10" in job.log("trainer1-new.0"), "the new trainer 1 to join")
        job.send_signal("trainer1", signal.SIGCONT)  # the old process wakes up and pushes step 10
        (job.pause / "go").touch()

        job.seen.old_code = job.wait("trainer1", 60)
        job.seen.codes = {
            name: job.wait(name, 120) for name in ("trainer0", "trainer1-new", "pserver0", "pserver1")
        }
        yield job
    finally:
        job.close()


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_stray_closes_and_a_second_process_for_a_live_id_change_nothing(job):
    for strays in job.seen.strays:
        for error in strays.errors:
            assert error is not None, "a stray Close was accepted"
            assert error.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
            assert "trainer" in error.details()
        assert sorted(strays.stats.trainers_alive) == [0, 1] and strays.stats.refused == len(STRAYS), (
            strays.stats
        )

    assert job.seen.dup_code != 0
    dup = job.log("trainer0-dup.0")
    assert "trainer 0 is already running" in dup and "opened from ipv4:127.0.0.1:" in dup, dup
    # The promise: a second process for a live id is refused within one alive window (plus a heartbeat
    # interval: ShardLink.hello_here's retries for a predecessor's session to age out), not after
    # connect_timeout, the Hello's own deadline. Halfway between the two.
    refused_within = (
        DistributeTranspilerConfig(heartbeat_interval=HEARTBEAT_INTERVAL).session_alive_window
        + HEARTBEAT_INTERVAL
    )
    assert job.seen.dup_seconds < (refused_within + CONNECT_TIMEOUT) / 2, job.seen.dup_seconds

    assert set(job.seen.codes.values()) == {0}, job.all_logs()
    job.assert_trained_as_one_process()


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_a_fenced_trainer_exits_and_its_late_push_is_not_applied(job):
    assert job.seen.old_code != 0
    old = job.log("trainer1.0")
    assert "FencedError" in old and "fenced: trainer 1 rejoined" in old, old
    assert "step 10 of trainer 1 (push and pull) failed: PERMISSION_DENIED" in old, old
    assert set(job.seen.codes.values()) == {0}, job.all_logs()
    for i in range(2):
        assert "trainer 1: a new process (from ipv4:127.0.0.1:" in job.log(f"pserver{i}.0")
    # Step 10 of trainer 1 counted once, from the new process: the model of an uninterrupted run.
    job.assert_trained_as_one_process()
