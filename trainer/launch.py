"""ps-launch: start and supervise the pservers and trainers of a job (usage: launch_plan.DESCRIPTION).

``main`` plans the roles (launch_plan), starts each in its own session with
its log file, prints the role table, supervises them and stops them all.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Callable, List, Optional, Sequence

from .launch_plan import PSERVER, TRAINER, LaunchError, Role, child_env, parse_args, plan_roles

POLL_INTERVAL = 0.1
TAIL_LINES = 20

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


def start_roles(roles: List[Role], script: str, script_args: Sequence[str], log_dir: str) -> None:
    """Start every role in its own session, stdout and stderr to its log in ``log_dir``.

    If one cannot be started, the ones already started are stopped and the error re-raised.
    """
    os.makedirs(log_dir, exist_ok=True)
    command = role_command(script, script_args)
    try:
        for role in roles:
            role.log_path = os.path.join(log_dir, role.log_name)
            with open(role.log_path, "wb") as log:
                # Own session: a terminal Ctrl-C reaches only the launcher, which
                # forwards it once, and killpg() also reaches the role's own children.
                role.proc = subprocess.Popen(command, env=child_env(role), stdin=subprocess.DEVNULL,
                                             stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    except BaseException:
        stop_roles(roles, timeout=5.0)
        raise


def _place(role: Role) -> str:
    if role.kind == PSERVER:
        return role.endpoint
    if role.local_world_size == 1 and "WORLD_SIZE" not in role.env:
        return f"trainer {role.index} on {role.host}"
    where = f"trainer node {role.index} local rank {role.local_rank}/{role.local_world_size}"
    if "PADDLE_PSERVERS_IP_PORT_LIST" not in role.env:  # collective: one group of the whole job
        where += f" rank {role.env['RANK']}/{role.env['WORLD_SIZE']}"
    return f"{where} on {role.host}"


def format_table(roles: List[Role]) -> str:
    """The table printed at start: role, index, endpoint or trainer node (and local rank), pid, log file."""
    rows = [("ROLE", "INDEX", "ENDPOINT / TRAINER ID", "PID", "LOG")]
    for r in roles:
        where = _place(r)
        rows.append((r.kind, str(r.index), where, str(r.proc.pid) if r.proc else "-", r.log_path or "-"))
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows)


def _signal(role: Role, sig: int) -> None:
    # The whole process group, so the role's own children go too; only while the
    # leader is unreaped, as then its pid (= group id) cannot have been reused.
    if role.alive:
        try:
            os.killpg(role.proc.pid, sig)
        except ProcessLookupError:
            pass


def stop_roles(roles: List[Role], timeout: float, hurry: Callable[[], bool] = lambda: False) -> List[Role]:
    """SIGTERM every live role, wait up to ``timeout`` s (less if ``hurry()``), then SIGKILL the rest.

    Returns the roles that had to be killed.
    """
    for role in roles:
        _signal(role, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(r.alive for r in roles) and time.monotonic() < deadline and not hurry():
        time.sleep(POLL_INTERVAL)
    killed = [r for r in roles if r.alive]
    for role in killed:
        _signal(role, signal.SIGKILL)
    for role in killed:
        try:
            role.proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            print(f"ps-launch: warning: {role.name} (pid {role.proc.pid}) survived SIGKILL", file=sys.stderr)
    return killed


def tail(path: Optional[str], lines: int = TAIL_LINES) -> str:
    """The last ``lines`` lines of a log file ('' if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 1024))
            return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
    except (OSError, TypeError):
        return ""


def _exit_text(role: Role) -> str:
    code = role.proc.returncode
    if code >= 0:
        return f"exited with code {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


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


def supervise(roles: List[Role], server_grace: Optional[float] = 30.0, term_timeout: float = 10.0,
              stops: Optional[StopSignals] = None) -> int:
    """Wait for the started roles and stop them; return the launcher's exit code.

    A role is one process; a trainer node of several processes is several roles.
    Trainers all exiting 0 is success (0): pservers then get ``server_grace`` s to
    exit by themselves before being stopped (None: wait for them, as when
    trainers on other hosts still use them; pservers exit once every trainer
    of the job has closed). Any role exiting non-zero fails the
    job (1): the others are stopped (a failed trainer node's other processes
    among them, which would wait in its collectives) and the failure is reported,
    naming the node and local rank, with its log's tail. A signal counted in
    ``stops`` stops every role (128 + signal number); one arriving while roles
    are being stopped cuts their SIGTERM grace short.
    """
    stops = stops or StopSignals()
    trainers = [r for r in roles if r.kind == TRAINER]
    servers = [r for r in roles if r.kind == PSERVER]

    def stop(which: List[Role]) -> List[Role]:
        seen = stops.count
        return stop_roles(which, term_timeout, hurry=lambda: stops.count > seen)

    grace_deadline = None
    while True:
        if stops.count:
            print(f"ps-launch: {signal.Signals(stops.signum).name} received; stopping {len(roles)} roles",
                  file=sys.stderr, flush=True)
            stop(roles)
            return 128 + stops.signum
        failed = [r for r in roles if r.proc.poll() not in (None, 0)]
        if failed:
            # A process killed by a signal is a cause, never a peer's consequence (those exit
            # with an error once a collective breaks): name it first.
            failed.sort(key=lambda r: r.proc.returncode >= 0)
            stop(roles)
            first = failed[0]
            also = "".join(f"\nps-launch: {r.title} {_exit_text(r)} too" for r in failed[1:])
            node = (f" (the other local ranks of trainer node {first.index} among them)"
                    if first.kind == TRAINER and first.local_world_size > 1 else "")
            print(f"ps-launch: {first.title} {_exit_text(first)}; stopped every other role{node}{also}\n"
                  f"ps-launch: last lines of {first.log_path}:\n{tail(first.log_path)}",
                  file=sys.stderr, flush=True)
            return 1
        if all(r.proc.returncode == 0 for r in trainers):
            live = [r for r in servers if r.alive]
            if not live:
                print("ps-launch: all roles finished", flush=True)
                return 0
            if not trainers or server_grace is None:
                pass  # pservers serve trainers elsewhere: they exit when those close
            elif grace_deadline is None:
                grace_deadline = time.monotonic() + server_grace
                print(f"ps-launch: all trainers finished; pservers get {server_grace:g} s to exit",
                      flush=True)
            elif time.monotonic() >= grace_deadline:
                print(f"ps-launch: stopping {', '.join(r.name for r in live)} after the grace period",
                      flush=True)
                for role in stop(live):
                    print(f"ps-launch: warning: {role.name} ignored SIGTERM and was killed",
                          file=sys.stderr, flush=True)
                return 0
        time.sleep(POLL_INTERVAL)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``ps-launch``: plan, start, print the table, supervise, return the exit code."""
    args = parse_args(argv)
    try:
        roles = plan_roles(args)
        os.makedirs(args.log_dir, exist_ok=True)
    except (LaunchError, OSError) as e:
        print(f"ps-launch: error: {e}", file=sys.stderr)
        return 2
    with StopSignals() as stops:
        try:
            start_roles(roles, args.script, args.script_args, args.log_dir)
        except OSError as e:  # start_roles has stopped the roles it did start
            print(f"ps-launch: error: cannot start the roles: {e}", file=sys.stderr)
            return 2
        try:
            print(format_table(roles), flush=True)
            local_nodes = len({r.index for r in roles if r.kind == TRAINER})
            all_trainers_here = local_nodes == int(roles[0].env["PADDLE_TRAINERS_NUM"])
            grace = args.server_grace if all_trainers_here else None
            return supervise(roles, grace, args.term_timeout, stops)
        finally:
            # Whatever went wrong above (even in the launcher itself), no role outlives it.
            stop_roles(roles, timeout=args.term_timeout)


if __name__ == "__main__":
    sys.exit(main())
