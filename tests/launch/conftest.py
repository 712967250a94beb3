"""Fixtures of the launcher's tests: a ps-launch started in the test's folder, closed at teardown."""

from __future__ import annotations

from typing import List

import pytest

from tests.helpers.launch import Launcher


@pytest.fixture
def launcher(tmp_path, monkeypatch):
    """Start a :class:`Launcher` in tmp_path (PROBE_DIR set for the probe scripts); closed at teardown."""
    probe = tmp_path / "probe"
    probe.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(probe))
    monkeypatch.delenv("PS_LOG_LEVEL", raising=False)
    started: List[Launcher] = []

    def start(*argv: str, log_dir: str = "logs") -> Launcher:
        started.append(Launcher(tmp_path, *argv, log_dir=log_dir))
        return started[-1]

    yield start
    for one in started:
        one.close()
