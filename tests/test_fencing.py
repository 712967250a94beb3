"""Sessions in real processes: one process per trainer id, stray messages, a fenced old process.

Each role is its own process (tests/scripts/recovery_job.py, heartbeat_interval 0.5 s, so a
session stays alive 1.5 s after its last call); the job pauses one trainer at a known step
(a file handshake). Every job must still end with the model of single-process PyTorch.
"""
from __future__ import annotations

import signal
import time

import grpc
import pytest

from psproto import ps_pb2

CLOSE = "/psproto.ParameterServer/Close"


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_stray_closes_and_a_second_process_for_a_live_id_change_nothing(job_factory):
    job = job_factory(args=["--pause_at", "10"])
    job.start_all()
    job.wait_file("reached")  # trainer 0 is about to train step 10; trainer 1 waits in the barrier

    # What a port scanner or a client pointed at the wrong port sends: parsed as "trainer N closes".
    strays = [b"", ps_pb2.CloseRequest(trainer_id=1).SerializeToString(),
              ps_pb2.CloseRequest(trainer_id=0, session="0123456789abcdef" * 2).SerializeToString()]
    for endpoint in job.endpoints:
        with grpc.insecure_channel(endpoint) as channel:
            close = channel.unary_unary(CLOSE)
            for message in strays:
                with pytest.raises(grpc.RpcError) as info:
                    close(message, timeout=10)
                assert info.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ABORTED)
                assert "trainer" in info.value.details()
            stats = ps_pb2.StatsReply.FromString(channel.unary_unary("/psproto.ParameterServer/Stats")(b"", timeout=10))
            assert sorted(stats.trainers_alive) == [0, 1] and stats.refused == len(strays), stats

    # A second process started as trainer 1 (a launcher typo) while trainer 1 lives.
    started = time.monotonic()
    job.start("TRAINER", 1, tag="-dup")
    assert job.wait("trainer1-dup", 60) != 0
    elapsed = time.monotonic() - started
    dup = job.log("trainer1-dup.0")
    assert "trainer 1 is already running" in dup and "opened from ipv4:127.0.0.1:" in dup, dup
    # Starting python and torch, then one alive window (1.5 s) of retries: seconds, not a hang.
    assert elapsed < 30, elapsed

    (job.pause / "go").touch()
    for name in ("trainer0", "trainer1", "pserver0", "pserver1"):
        assert job.wait(name, 120) == 0, job.all_logs()
    job.assert_trained_as_one_process()


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_a_fenced_trainer_exits_and_its_late_push_is_not_applied(job_factory):
    job = job_factory(args=["--pause_at", "10", "--pause_trainer", "1"])
    job.start_all()
    job.wait_file("reached")                             # trainer 1 is about to train step 10
    job.send_signal("trainer1", signal.SIGSTOP)          # its VM pauses: no heartbeat, no call
    job.start("TRAINER", 1, tag="-new")                  # and it is restarted elsewhere meanwhile
    job.wait_until(lambda: "ready at step 10" in job.log("trainer1-new.0"), "the new trainer 1 to join")
    job.send_signal("trainer1", signal.SIGCONT)          # the old process wakes up and pushes step 10
    (job.pause / "go").touch()

    assert job.wait("trainer1", 60) != 0
    old = job.log("trainer1.0")
    assert "FencedError" in old and "fenced: trainer 1 rejoined" in old, old
    assert "step 10 of trainer 1 (push and pull) failed: PERMISSION_DENIED" in old, old
    for name in ("trainer0", "trainer1-new", "pserver0", "pserver1"):
        assert job.wait(name, 120) == 0, job.all_logs()
    for i in range(2):
        assert "trainer 1: a new process (from ipv4:127.0.0.1:" in job.log(f"pserver{i}.0")
    # Step 10 of trainer 1 counted once, from the new process: the model of an uninterrupted run.
    job.assert_trained_as_one_process()
