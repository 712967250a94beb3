"""The etcd of the replication tests: :mod:`harness.etcd`'s real server, or a skip where it is missing.

Where ``etcd`` is not installed the tests skip (or fail under ``PS_REQUIRE_SYSTEM_TESTS=1``) through
:func:`tests.helpers.system.unavailable`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from harness.etcd import EtcdMissing, EtcdServer, start_etcd
from tests.helpers.system import unavailable


def etcd_or_skip(tmp_path: Path, host: str = "127.0.0.1") -> EtcdServer:
    """:func:`harness.etcd.start_etcd` in ``tmp_path``; the test skips (or fails where system tests are
    required) when ``etcd`` is not on PATH."""
    try:
        return start_etcd(tmp_path, host=host)
    except EtcdMissing as e:
        unavailable(str(e))


@pytest.fixture(name="etcd")
def etcd_fixture(tmp_path) -> Iterator[EtcdServer]:
    """A fresh etcd for one test (``from tests.helpers.etcd import etcd_fixture  # noqa: F401``); stopped
    at teardown."""
    server = etcd_or_skip(tmp_path)
    try:
        yield server
    finally:
        server.stop()
