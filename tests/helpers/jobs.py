"""A job of real processes for the fault tests: every role of tests/scripts/recovery_job.py on loopback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional

import pytest
import torch

from harness.models import FLOAT64_JOB
from harness.ports import free_ports
from tests.helpers.paths import SCRIPTS
from tests.scripts import recovery_job

SCRIPT = str(SCRIPTS / "recovery_job.py")


def assert_job_models_close(
    out, expected: dict, n_trainers: int = 2, detail: Optional[Callable[[], str]] = None
) -> None:
    """Each trainer's final model (OUT/trainer-<id>.pt) of a job of recovery_job.py run with
    ``recovery_job.FLOAT64`` equals ``expected`` (its :func:`recovery_job.reference` in float64) to
    FLOAT64_JOB. ``detail()``: more to say on a failure (the job's logs)."""
    for tid in range(n_trainers):
        state = torch.load(Path(out) / f"trainer-{tid}.pt", weights_only=True)
        assert state.keys() == expected.keys()
        for k in expected:
            assert state[k].dtype == torch.float64, (
                f"trainer {tid}, {k}: {state[k].dtype}; run the job with recovery_job.FLOAT64 (in float32 "
                "its distance to one process depends on the CPU's kernels)"
            )
            torch.testing.assert_close(
                state[k],
                expected[k],
                **FLOAT64_JOB,
                msg=lambda m: f"trainer {tid}, {k}: {m}\n{detail() if detail else ''}",
            )


class Job:
    """The processes of one job; every one is killed at exit, whatever happened."""

    def __init__(self, tmp_path, n_pservers: int = 2, n_trainers: int = 2, args=()):
        self.tmp = tmp_path
        self.endpoints = [f"127.0.0.1:{p}" for p in free_ports(n_pservers)]
        self.n_trainers = n_trainers
        self.ckpt = str(tmp_path / "ckpt")
        self.out = tmp_path / "out"
        self.pause = tmp_path / "pause"
        self.out.mkdir()
        self.pause.mkdir()
        self.args = [
            "--checkpoint_dir",
            self.ckpt,
            "--out_dir",
            str(self.out),
            "--pause_dir",
            str(self.pause),
            *args,
        ]
        self.procs: Dict[str, subprocess.Popen] = {}
        self.logs: Dict[str, str] = {}
        self.waited: set = set()  # processes whose exit the test has taken: no longer a surprise

    def env(self, role: str, index: int, endpoints=None) -> dict:
        """The role variables of role ``index``; ``endpoints``: the pservers it is given (default: the job's;
        pserver ``index`` is the one at that position)."""
        endpoints = self.endpoints if endpoints is None else endpoints
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PADDLE_", "PS_", "TRAINING_"))}
        env.update(
            TRAINING_ROLE=role,
            PADDLE_PSERVERS_IP_PORT_LIST=",".join(endpoints),
            PADDLE_TRAINERS_NUM=str(self.n_trainers),
            PYTHONUNBUFFERED="1",
        )
        if role == "PSERVER":
            host, port = endpoints[index].rsplit(":", 1)
            env.update(POD_IP=host, PADDLE_PORT=port)
        else:
            env["PADDLE_TRAINER_ID"] = str(index)
        return env

    def start(self, role: str, index: int, tag: str = "", endpoints=None) -> subprocess.Popen:
        """Start role ``index`` (again: the same command); ``tag`` names a second process of the same role;
        ``endpoints``: the pservers it is given (:meth:`env`)."""
        name = f"{role.lower()}{index}{tag}"
        n = sum(k.rsplit(".", 1)[0] == name for k in self.logs)
        path = str(self.tmp / f"{name}.{n}.log")
        with open(path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, SCRIPT, *self.args],
                env=self.env(role, index, endpoints),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs[name], self.logs[f"{name}.{n}"] = proc, path
        self.waited.discard(name)
        return proc

    def start_all(self) -> None:
        for i in range(len(self.endpoints)):
            self.start("PSERVER", i)
        for i in range(self.n_trainers):
            self.start("TRAINER", i)

    def log(self, name: str) -> str:
        with open(self.logs[name], errors="replace") as f:
            return f.read()

    def all_logs(self, first: str = "") -> str:
        """Every role's log tail, role ``first``'s at the top (a failure's own log, where a cut report
        still shows it)."""
        order = sorted(self.logs, key=lambda k: not k.startswith(first) if first else False)
        return "\n".join(f"===== {k}\n{self.log(k)[-3000:]}" for k in order)

    def wait_until(self, ready, what: str, timeout: float = 60.0) -> None:
        """Poll ``ready()`` until true, failing early (with the logs) if a role dies meanwhile or every
        role has ended. A role that ends with status 0 has finished its work, not died: in asynchronous
        modes one trainer may well finish before another reaches the point waited for."""
        deadline = time.monotonic() + timeout
        while not ready():
            ended = {k: p.returncode for k, p in self.procs.items() if p.poll() is not None}
            dead = {k: rc for k, rc in ended.items() if k not in self.waited and rc != 0}
            if len(ended) == len(self.procs):
                dead = dead or ended
            assert not dead and time.monotonic() < deadline, f"waiting for {what}: {dead}\n{self.all_logs()}"
            time.sleep(0.05)

    def wait_file(self, name: str, timeout: float = 60.0) -> None:
        """Wait for PAUSE_DIR/name."""
        self.wait_until((self.pause / name).exists, name, timeout)

    def wait(self, name: str, timeout: float) -> int:
        self.waited.add(name)
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{name} did not finish within {timeout}s\n{self.all_logs()}")

    def assert_trained_as_one_process(self, epochs: int = 2) -> None:
        """Every trainer's saved final model equals single-process training on the same data (the job
        runs with ``recovery_job.FLOAT64``)."""
        assert_job_models_close(self.out, recovery_job.reference(epochs=epochs, dtype=torch.float64))

    def kill(self, name: str) -> None:
        proc = self.procs[name]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        self.waited.add(name)  # its end is the test's doing: no surprise for wait_until

    def send_signal(self, name: str, signum: int) -> None:
        """Send ``signum`` to the process group of ``name`` (SIGSTOP / SIGCONT: a VM paused and resumed)."""
        os.killpg(self.procs[name].pid, signum)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # a stopped process dies of it too
                proc.wait(10)
