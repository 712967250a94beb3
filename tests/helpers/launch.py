"""Running ``ps-launch`` from a test, and watching the processes it starts."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

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


class Launcher:
    """``python -m trainer.launch ARGS`` in ``cwd``, its stdout and stderr in files (a pipe nobody reads
    would fill up and stall it). :meth:`close` stops it and SIGKILLs any role it left."""

    def __init__(self, cwd: Path, *argv: str, log_dir: str = "logs") -> None:
        self.cwd, self.log_dir = cwd, cwd / log_dir
        self.out_path, self.err_path = cwd / "launcher.out", cwd / "launcher.err"
        if log_dir != "log":  # "log" is the launcher's default: left out, so that the default is what runs
            argv = ("--log_dir", log_dir, *argv)
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainer.launch", *argv],
                cwd=cwd,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
            )
        self.seen_pids: set = set()

    # Bytes decoded, not read_text(): universal newlines would turn every '\r' into '\n'.
    def out(self) -> str:
        return self.out_path.read_bytes().decode(errors="replace")

    def err(self) -> str:
        return self.err_path.read_bytes().decode(errors="replace")

    def roles(self) -> Dict[str, dict]:
        """roles.json by role name ({} until the launcher wrote it)."""
        try:
            listed = json.loads((self.log_dir / "roles.json").read_text())["roles"]
        except (OSError, ValueError, KeyError):
            return {}
        found = {r["name"]: r for r in listed}
        self.seen_pids |= {r["pid"] for r in listed if r["pid"]}
        return found

    def log(self, name: str) -> str:
        return (self.log_dir / name).read_bytes().decode(errors="replace")

    def wait_until(self, ready, what: str, timeout: float):
        """Poll ``ready()``; fail (with the console and logs) on the deadline or if the launcher exits
        first."""
        deadline = time.monotonic() + timeout
        while True:
            value = ready()
            if value:
                return value
            if self.proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"waiting for {what}: launcher exit code {self.proc.poll()}\n{self.story()}")
            time.sleep(0.05)

    def finish(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"ps-launch did not finish within {timeout} s\n{self.story()}")

    def story(self) -> str:
        logs = "".join(
            f"\n===== {p.name}\n{p.read_text(errors='replace')[-3000:]}"
            for p in sorted(self.log_dir.glob("*log.*"))
        )
        return f"===== stdout\n{self.out()[-4000:]}\n===== stderr\n{self.err()[-4000:]}{logs}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # the launcher stops its roles on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.roles()
        for pid in self.seen_pids:  # the launcher's own clean-up is under test: do not rely on it
            if pid_alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def kill_role(job: Launcher, name: str) -> int:
    """SIGKILL the live process of role ``name`` (its pid from roles.json); returns the pid."""
    pid = job.roles()[name]["pid"]
    assert pid_alive(pid), f"{name} (pid {pid}) is not running\n{job.story()}"
    os.kill(pid, signal.SIGKILL)
    return pid


def restarted(job: Launcher, name: str, old_pid: int) -> Optional[dict]:
    """Role ``name`` from roles.json once it runs a process other than ``old_pid``, restarted once."""
    role = job.roles().get(name)
    return role if role and role["pid"] != old_pid and role["restarts"] == 1 else None


def prefixed(out: str, tag: str) -> List[str]:
    """The console lines of role ``tag`` (``[tag] ...``), the tag taken off."""
    return [line[len(tag) + 3 :] for line in out.splitlines() if line.startswith(f"[{tag}] ")]
