"""Child processes of the benchmarks and the system tests: a command with a deadline, its whole tree stopped.

Every child started here gets :func:`die_with_parent` and runs in a session of its own;
a failure is a :class:`RunFailed` whose message ends with the tail of the child's log.

A run (``ps-launch`` and its roles, a torch peer and its spawned ranks, Paddle's
launcher, ps-launch inside a network namespace) is killed as a tree, SIGTERM first
and SIGKILL after a grace period, on timeout, on failure and when the caller itself
is interrupted; each child also gets SIGKILL if its starter dies (Linux
``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import subprocess
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

log = logging.getLogger("harness.processes")

# SIGTERM first, SIGKILL after this many seconds (ps-launch itself gives its roles 10 s).
STOP_GRACE = 15.0
# How often a running command's process tree is re-read (to kill it whole later).
TREE_POLL = 2.0


class RunFailed(RuntimeError):
    """A run's process failed or missed its deadline; the message says which and why."""


def die_with_parent() -> None:
    """In the child before exec (``preexec_fn``): get SIGKILL if its starter dies (Linux)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def tail(path: str, lines: int = 25) -> str:
    """The last ``lines`` lines of a log file, indented, for error messages."""
    try:
        with open(path, errors="replace") as f:
            text = f.readlines()[-lines:]
    except OSError as e:
        return f"    (no log: {e})"
    return "".join("    " + line for line in text).rstrip()


def _raise_on_signal(signum, frame):
    raise SystemExit(128 + signum)


def stop_on_signals() -> None:
    """Turn SIGTERM and SIGHUP into SystemExit(128 + signal), so ``with`` blocks stop the children (a
    benchmark's ``main``)."""
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)


def _process_table() -> Dict[int, Tuple[int, int]]:
    """{pid: (parent pid, start time in clock ticks)} of every process, from /proc."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        table[int(name)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root: int) -> Set[Tuple[int, int]]:
    """(pid, start time) of every living descendant of ``root``, in any session."""
    table = _process_table()
    children: Dict[int, List[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = set(), [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.add((pid, table[pid][1]))
            todo.append(pid)
    return found


def _alive(pid: int, start: int) -> bool:
    """Whether ``pid`` is still the process that started at ``start`` (not a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return False
    fields = text[text.rindex(")") + 2 :].split()
    return int(fields[19]) == start and fields[0] != "Z"


class Command:
    """One subprocess with a deadline; leaving the ``with`` block kills it and every process it started.

    The command runs in its own session with stdout and stderr in ``log_path``.
    Its process tree is re-read every few seconds while it runs, so children
    that moved to sessions of their own (ps-launch's roles) or were orphaned
    are stopped too: SIGTERM to the session and to each of them, then SIGKILL
    after :data:`STOP_GRACE` s. A pid is only signalled while it is still the
    process seen before (same start time).
    """

    def __init__(
        self,
        cmd: Sequence[str],
        log_path: str,
        env: Optional[Dict[str, str]] = None,
        cwd: Optional[str] = None,
    ):
        self.cmd = list(cmd)
        self.log_path = log_path
        self.tree: Set[Tuple[int, int]] = set()
        log.debug("running %s", " ".join(self.cmd))
        with open(log_path, "w") as out:
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})},
                cwd=cwd,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )

    def __enter__(self) -> "Command":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def wait(self, timeout: float, what: str) -> int:
        """Wait up to ``timeout`` s for the command to exit; its exit status. RunFailed past the deadline."""
        deadline = time.monotonic() + timeout
        next_scan = 0.0
        while True:
            if time.monotonic() >= next_scan:
                self.tree |= descendants(self.proc.pid)
                next_scan = time.monotonic() + TREE_POLL
            try:
                return self.proc.wait(timeout=min(0.2, max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                if time.monotonic() >= deadline:
                    raise RunFailed(
                        f"{what}: deadline of {timeout:.0f} s passed; stopped it and its "
                        f"children; log {self.log_path}:\n{tail(self.log_path)}"
                    ) from None

    def stop(self) -> None:
        """Stop the command and everything it started that is still running (TERM, then KILL)."""
        if self.proc.poll() is None:
            self.tree |= descendants(self.proc.pid)
        self._signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE
        while time.monotonic() < deadline and self._running():
            time.sleep(0.1)
        if self._running():
            log.warning("%s: still running %.0f s after SIGTERM, killing it", self.cmd[1:3], STOP_GRACE)
            self._signal(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=STOP_GRACE)

    def _running(self) -> bool:
        return self.proc.poll() is None or any(_alive(pid, start) for pid, start in self.tree)

    def _signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)
        for pid, start in self.tree:
            if _alive(pid, start):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, sig)


def run_command(
    cmd: Sequence[str],
    log_path: str,
    timeout: float,
    what: str,
    env: Optional[Dict[str, str]] = None,
    cwd: Optional[str] = None,
) -> str:
    """Run ``cmd`` to completion within ``timeout`` s (else killed with its tree); its output. RunFailed
    unless 0."""
    with Command(cmd, log_path, env, cwd) as c:
        rc = c.wait(timeout, what)
    if rc != 0:
        raise RunFailed(f"{what} exited with status {rc}; log {log_path}:\n{tail(log_path)}")
    with open(log_path, errors="replace") as f:
        return f.read()


def last_json_line(text: str, what: str) -> dict:
    """The last line of ``text`` that parses as a JSON object (the peers print one)."""
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                return json.loads(line)
    raise RunFailed(f"{what} printed no JSON result")
