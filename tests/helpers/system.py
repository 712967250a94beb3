"""Tests that need the machine itself (root, network namespaces, Slurm): skip, or fail where required.

``tests/system/test_slurm.py`` and ``tests/system/test_two_hosts.py`` cannot run everywhere: a developer
without root, ``ip`` or Slurm gets a skip naming what is missing. CI exports ``PS_REQUIRE_SYSTEM_TESTS=1``
(``.ci/run``): there the same condition is a failure, so a green CI run is one in which these tests ran.
Every "cannot run here" decision of those modules goes through :func:`unavailable`.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from typing import List, NoReturn, Optional, Sequence

import pytest

REQUIRE_VAR = "PS_REQUIRE_SYSTEM_TESTS"


def required() -> bool:
    """True where ``PS_REQUIRE_SYSTEM_TESTS`` is set to anything but empty or ``0``: the system tests must
    run."""
    return os.environ.get(REQUIRE_VAR, "").strip() not in ("", "0")


def unavailable(reason: str) -> NoReturn:
    """Stop a system test's setup that cannot run here: skip with ``reason``, or fail with it where
    :func:`required`.

    ``reason`` names the failing command or the missing binary and its output. Call it from a fixture after
    whatever the fixture started has been cleaned up (or from inside its ``try``/``finally``): both
    outcomes are exceptions, so the cleanup still runs.
    """
    if required():
        pytest.fail(
            f"{reason}\n({REQUIRE_VAR}={os.environ[REQUIRE_VAR]}: this system test may not skip)",
            pytrace=False,
        )
    pytest.skip(reason)


def missing_prerequisites(binaries: Sequence[str], install: str) -> Optional[str]:
    """Why a system test cannot even start here, or None: not Linux, or one of ``binaries`` not on PATH.

    ``install`` is the command that installs what is missing (for the message), e.g.
    ``apt-get install iproute2``.
    """
    if not sys.platform.startswith("linux"):
        return f"network namespaces are Linux-only (sys.platform is {sys.platform!r})"
    missing = [b for b in binaries if shutil.which(b) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (not on PATH={os.environ.get('PATH', '')!r}; {install})"
    return None


def clear_namespace(ns: str, timeout: float = 5.0) -> None:
    """SIGKILL every process left in network namespace ``ns``, then delete it; never raises.

    Only for a namespace the caller created: everything in it is the test's. Processes that
    left their starter's session (slurmstepd, job tasks) are found by ``ip netns pids``; killing
    is repeated until the namespace is empty, because a dying process's children may appear
    after the first listing.
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            break
        pids = [int(p) for p in r.stdout.split()] if r.returncode == 0 else []
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)  # poll interval: a SIGKILLed process leaves the namespace asynchronously
    try:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        pass


def run(cmd: List[str], timeout: float = 20) -> subprocess.CompletedProcess:
    """Run ``cmd`` (no shell), capturing its output as text; a failure to start or a timeout reads as exit
    -1."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        return subprocess.CompletedProcess(cmd, -1, "", str(e))


def in_ns(ns: str, *cmd: str) -> List[str]:
    """``cmd`` run inside network namespace ``ns``."""
    return ["ip", "netns", "exec", ns, *cmd]
