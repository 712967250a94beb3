"""Fixtures of the deploy recipes' tests."""

from __future__ import annotations

import shutil

import pytest


@pytest.fixture
def etcd_binary() -> str:
    path = shutil.which("etcd")
    if path is None:
        from tests.helpers.system import unavailable

        unavailable("not installed: etcd (apt-get install etcd-server)")
    return path
