"""Pservers as real processes (the ps-server command), trainers in this process."""

import os
import queue
import signal
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

from harness.models import FLOAT64_EXACT, batches, odd_program
from harness.ports import free_ports
from tests.helpers import paths
from trainer import Trainer
from transpiler import DistributeTranspiler

# Every test here starts pservers and trainers as separate processes.
pytestmark = pytest.mark.processes

REPO = str(paths.REPO)


def start_pservers(endpoints, trainers, extra=()):
    procs = []
    for ep in endpoints:
        host, port = ep.rsplit(":", 1)
        env = {
            **os.environ,
            "TRAINING_ROLE": "PSERVER",
            "PADDLE_PSERVERS_IP_PORT_LIST": ",".join(endpoints),
            "PADDLE_TRAINERS_NUM": str(trainers),
            "POD_IP": host,
            "PADDLE_PORT": port,
            "PYTHONPATH": REPO,
        }
        procs.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "pserver.cli",
                    "--program",
                    "harness/models.py:odd_program",
                    *extra,
                ],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return procs


def stop(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


@pytest.mark.timeout(90)
def test_sync_training_against_pserver_processes_matches_single_process():
    endpoints = [f"127.0.0.1:{p}" for p in free_ports(2)]
    data = batches(2, 8, 3, dtype=torch.float64)
    procs = start_pservers(endpoints, 2)
    try:
        import threading

        states, errors = {}, []

        def run(i):
            try:
                t = DistributeTranspiler()
                t.transpile(i, program=odd_program(), pservers=endpoints, trainers=2)
                with Trainer(t.get_trainer_program()) as tr:
                    for step_batches in data:
                        x, y = step_batches[i]
                        nn.functional.cross_entropy(tr.model(x), y).backward()
                        tr.step()
                    states[i] = tr.state_dict()
            except Exception as e:
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
        assert not errors, errors
        assert not any(th.is_alive() for th in threads), "a trainer did not finish within 60 s"
        # Each pserver exits by itself, cleanly, once both trainers closed.
        for p in procs:
            out, _ = p.communicate(timeout=30)
            assert p.returncode == 0, out
            assert "all 2 trainers closed" in out
    finally:
        stop(procs)

    prog = odd_program()
    opt = prog.optimizer.build(prog.model.parameters())
    for step_batches in data:
        opt.zero_grad()
        x = torch.cat([b[0] for b in step_batches])
        y = torch.cat([b[1] for b in step_batches])
        nn.functional.cross_entropy(prog.model(x), y).backward()
        opt.step()
    for i in range(2):
        for name, value in prog.model.state_dict().items():
            torch.testing.assert_close(
                states[i][name], value, **FLOAT64_EXACT, msg=lambda m: f"trainer {i}, {name}: {m}"
            )


@pytest.mark.timeout(60)
def test_pserver_process_stops_cleanly_on_sigterm():
    endpoints = [f"127.0.0.1:{free_ports(1)[0]}"]
    procs = start_pservers(endpoints, 1)
    try:
        # Wait until it serves: a trainer can register.
        t = DistributeTranspiler()
        t.transpile(0, program=odd_program(), pservers=endpoints, trainers=1)
        tr = Trainer(t.get_trainer_program())
        tr.channels.shutdown()  # leave without closing: the pserver still expects this trainer
        procs[0].send_signal(signal.SIGTERM)
        out, _ = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 0, out
        assert "SIGTERM received, shutting down" in out
    finally:
        stop(procs)


SIGTERM_ROUNDS = 12


@pytest.mark.timeout(120)
def test_a_pserver_stopped_by_sigterm_again_and_again_prints_only_its_log(tmp_path):
    """A SIGTERM at the end of a job stops a pserver quietly: no asyncio traceback from gRPC's poller.

    The poller's socket was closed by the main thread while the event loop's thread still read it
    (``Exception in callback None()`` ... ``OSError: [Errno 9] Bad file descriptor``), in about one
    stop in three here; :class:`~pserver.server.ParameterServer` now stops the loop first. One
    process serves and is stopped :data:`SIGTERM_ROUNDS` times (tests/scripts/sigterm_rounds.py:
    ps-server's main again and again), so the stops are many and the test stays short.
    """
    stderr_path = tmp_path / "stderr"
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "tests/scripts/sigterm_rounds.py",
                "--rounds",
                str(SIGTERM_ROUNDS),
                "--deadline",
                "100",
            ],
            cwd=REPO,
            env={**os.environ, "PYTHONPATH": REPO},
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    lines: "queue.Queue[str]" = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line.strip()) for line in proc.stdout], daemon=True)
    reader.start()
    try:
        for round_ in range(SIGTERM_ROUNDS):
            assert lines.get(timeout=60) == f"serving {round_}", stderr_path.read_text()[-3000:]
            proc.send_signal(signal.SIGTERM)
            assert lines.get(timeout=30) == f"stopped {round_} 0", stderr_path.read_text()[-3000:]
        assert proc.wait(30) == 0
    finally:
        stop([proc])
    log = stderr_path.read_text()
    assert log.count("SIGTERM received, shutting down") == SIGTERM_ROUNDS
    assert "Traceback" not in log and "Exception in callback" not in log, log
    # Each line is one of the pserver's log records (a clean stop prints nothing else).
    assert all(" INFO " in line or " WARNING " in line for line in log.splitlines()), log


@pytest.mark.timeout(60)
def test_ps_server_refuses_bad_configuration():
    endpoints = [f"127.0.0.1:{free_ports(1)[0]}"]
    procs = start_pservers(endpoints, 1, extra=("--min_block_size", "100"))
    try:
        out, _ = procs[0].communicate(timeout=30)
        assert procs[0].returncode == 2
        assert "min_block_size=100 is refused" in out
    finally:
        stop(procs)
