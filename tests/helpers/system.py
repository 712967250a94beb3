"""Tests that need the machine itself (root, network namespaces, Slurm): skip, or fail where required.

``tests/system/test_slurm.py`` and ``tests/system/test_two_hosts.py`` cannot run everywhere: a developer
without root, ``ip`` or Slurm gets a skip naming what is missing. CI exports ``PS_REQUIRE_SYSTEM_TESTS=1``
(``.ci/run``): there the same condition is a failure, so a green CI run is one in which these tests ran.
Every "cannot run here" decision of those modules goes through :func:`unavailable`. The namespaces
themselves are made and removed with :mod:`harness.netns`.
"""

from __future__ import annotations

import os
import shutil
import sys
from typing import Iterator, NoReturn, Optional, Sequence

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


def netns_hosts(count: int, tag: Optional[int] = None) -> Iterator:
    """A module fixture's body: ``count`` network-namespace hosts (harness.netns.Hosts) set up, yielded, torn
    down; the test is unavailable (skipped, or failed under PS_REQUIRE_SYSTEM_TESTS=1) without them."""
    from harness.netns import Hosts, NetnsError

    reason = missing_prerequisites(["ip"], "apt-get install iproute2")
    if reason:
        unavailable(reason)
    cluster = Hosts(count, tag=tag)
    try:
        cluster.setup()
    except NetnsError as e:
        cluster.teardown()
        unavailable(
            f"network namespace setup failed (needs root / CAP_NET_ADMIN and namespaces allowed): {e}"
        )
    try:
        yield cluster
    finally:
        cluster.teardown()
