"""Running ``ps-launch`` from a test, and watching the processes it starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, List, Optional

import pytest

from tests.helpers import paths

PROBE = str(paths.SCRIPTS / "role_probe.py")  # a role that records what it was started with


def args_for(*argv: str, script: str = PROBE):
    """ps-launch's parsed arguments for ``argv`` and ``script`` (the probe by default)."""
    from trainer.launch import plan

    return plan.parse_args([*argv, script])


def run_ps_launch(args, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``python -m trainer.launch ARGS`` in ``cwd``; SIGTERM (which stops its roles) on timeout."""
    argv = [sys.executable, "-m", "trainer.launch", *args]
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its roles on SIGTERM
            out, err = proc.communicate(timeout=20)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


class Launchers:
    """Starts ``python -m trainer.launch ARGS`` in ``cwd``; :meth:`close` stops any still running."""

    def __init__(self, cwd: Path) -> None:
        self.cwd, self.procs = cwd, []

    def start(self, *argv: str, env: Optional[dict] = None) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-m", "trainer.launch", *argv],
            cwd=self.cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=dict(os.environ, **(env or {})),
        )
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.communicate(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.communicate()


def finish(proc: subprocess.Popen, timeout: float):
    """(exit code, stdout, stderr) of a launcher once it exits."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def wait_for(predicate: Callable[[], object], timeout: float, what: str):
    """Poll ``predicate`` (every 50 ms) until it is truthy; fail the test naming ``what`` on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


def pid_alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def records(d: Path) -> dict:
    """The probes' ``<name>.json`` records in ``d``, by name."""
    return {p.stem: json.loads(p.read_text()) for p in d.glob("*.json")}


def assert_all_gone(recs: dict) -> None:
    """No recorded process is still alive."""
    assert recs
    alive = {name: r["pid"] for name, r in recs.items() if pid_alive(r["pid"])}
    assert not alive, f"roles outlived the launcher: {alive}"


def kill_probes(d: Path, script_names: List[bytes]) -> None:
    """SIGKILL every recorded probe still running one of ``script_names`` (test teardown)."""
    for record in d.glob("*.json"):
        pid = json.loads(record.read_text())["pid"]
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(name in cmdline for name in script_names):
            os.kill(pid, signal.SIGKILL)
