"""The processes of ps-launch's roles: starting (and starting again), signalling, stopping, the pid file.

Thin I/O around :class:`plan.Role`: each role runs in its own session
(process group) with its output in its log file.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

from .restart import exit_reason
from .role import Role, child_env

log = logging.getLogger("ps-launch")

POLL_INTERVAL = 0.1
TAIL_LINES = 20
ROLES_FILE = "roles.json"

# Each role starts through this stub on Linux: if the launcher is SIGKILLed it
# cannot clean up, so the stub asks the kernel for a SIGTERM when the launcher
# dies (PR_SET_PDEATHSIG, kept across exec) and then execs the script in place.
# A stub rather than preexec_fn, which is unsafe in a process with threads (torch's).
_PDEATHSIG_STUB = """import ctypes, os, sys
try:
    ctypes.CDLL(None).prctl(1, 15)
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execv(sys.executable, [sys.executable] + sys.argv[2:])
"""


def role_command(script: str, script_args: Sequence[str]) -> List[str]:
    """The command line of a role: ``sys.executable SCRIPT ARGS...`` (via the parent-death stub on Linux)."""
    if sys.platform.startswith("linux"):
        return [sys.executable, "-c", _PDEATHSIG_STUB, str(os.getpid()), script, *script_args]
    return [sys.executable, script, *script_args]


def start_role(role: Role, note: str = "") -> None:
    """Start ``role.command`` in its own session, output to ``role.log_path``.

    The first start truncates the log; with a ``note`` (a restart) the log is
    appended to, after a line that says what happened, so one file tells the role's whole story.
    """
    with open(role.log_path, "ab" if note else "wb") as out:
        if note:
            out.write(f"\n===== ps-launch: {note} =====\n".encode())
            out.flush()
        # Own session: a terminal Ctrl-C reaches only the launcher, which
        # forwards it once, and killpg() also reaches the role's own children.
        role.started(
            subprocess.Popen(
                role.command,
                env=child_env(role),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )


def start_roles(roles: List[Role], script: str, script_args: Sequence[str], log_dir: str) -> None:
    """Start every role in its own session, stdout and stderr to its log in ``log_dir``.

    If one cannot be started, the ones already started are stopped and the error re-raised.
    """
    os.makedirs(log_dir, exist_ok=True)
    command = role_command(script, script_args)
    try:
        for role in roles:
            role.log_path = os.path.join(log_dir, role.log_name)
            role.command = command
            start_role(role)
    except BaseException:
        stop_roles(roles, timeout=5.0)
        raise


def _signal(role: Role, sig: int) -> None:
    # The whole process group, so the role's own children go too; only while the
    # leader is unreaped, as then its pid (= group id) cannot have been reused.
    if role.alive:
        try:
            os.killpg(role.proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_roles(
    roles: List[Role],
    timeout: float,
    hurry: Callable[[], bool] = lambda: False,
    tick: Callable[[], None] = lambda: None,
) -> List[Role]:
    """SIGTERM every live role, wait up to ``timeout`` s (less if ``hurry()``), then SIGKILL the rest.

    ``tick()`` runs while waiting (the console keeps copying output). Returns the roles that had to be killed.
    """
    for role in roles:
        _signal(role, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(r.alive for r in roles) and time.monotonic() < deadline and not hurry():
        tick()
        time.sleep(POLL_INTERVAL)
    killed = [r for r in roles if r.alive]
    for role in killed:
        _signal(role, signal.SIGKILL)
    for role in killed:
        try:
            role.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            log.warning("warning: %s (pid %d) survived SIGKILL", role.name, role.proc.pid)
    return killed


def tail(path: Optional[str], lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except (OSError, TypeError):
        return ""


def write_roles_file(log_dir: str, roles: List[Role]) -> None:
    """``LOG_DIR/roles.json``: the launcher's pid and each role's name, tag, endpoint, pid, restarts, log
    and exit status.

    Rewritten (atomically) at every start and restart, so tools and tests find the live process of a role;
    ``returncode`` is null while it runs.
    """
    doc = {
        "launcher_pid": os.getpid(),
        "roles": [
            {
                "name": r.name,
                "tag": r.tag,
                "kind": r.kind,
                "index": r.index,
                "local_rank": r.local_rank,
                "endpoint": r.endpoint,
                "pid": r.proc.pid if r.proc else None,
                "restarts": r.restarts,
                "log": r.log_path,
                "returncode": r.proc.returncode if r.proc else None,
            }
            for r in roles
        ],
    }
    path = os.path.join(log_dir, ROLES_FILE)
    try:
        with open(path + ".tmp", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(path + ".tmp", path)
    except OSError as e:  # informative only: the job goes on without it
        log.warning("warning: cannot write %s: %s", path, e)


def exit_text(role: Role) -> str:
    """How the role's process ended, in words (``exited with code 3``, ``was killed by SIGKILL``)."""
    return exit_reason(role.proc.returncode)


class StopSignals:
    """Counts SIGTERM/SIGINT and remembers the last one; as a context manager, installs the handlers.

    The handlers only record: the supervisor loop acts on them, so a signal
    never interrupts the launcher halfway through starting or reaping a child.
    """

    def __init__(self) -> None:
        self.count, self.signum, self._previous = 0, 0, {}

    def _handle(self, signum, frame) -> None:
        self.count += 1
        self.signum = signum

    def __enter__(self) -> "StopSignals":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
