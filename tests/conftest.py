"""Fixtures shared by the test modules."""

from __future__ import annotations

from typing import List

import pytest
import torch

from tests.helpers.jobs import Job
from tests.helpers.launch import Launchers, kill_probes

# One torch thread in each pytest process, as in the roles the tests start: the two xdist workers and
# their jobs share 2 cores, and with torch's default (a thread per core) a worker's kernels wait for a
# thread spinning on a core that the other holds (under load, tests/pserver/test_flat_store.py and three
# more files took 99-124 s so, 36-42 s on one thread).
torch.set_num_threads(1)


@pytest.fixture
def job_factory(tmp_path):
    """Make :class:`Job` s (real processes) in ``tmp_path``; every process of each is killed at the end."""
    jobs: List[Job] = []

    def make(**kwargs) -> Job:
        jobs.append(Job(tmp_path, **kwargs))
        return jobs[-1]

    yield make
    for job in jobs:
        job.close()


@pytest.fixture
def probe_dir(tmp_path, monkeypatch):
    """A directory the launcher tests' probe scripts report to; every probe still alive at teardown is
    killed."""
    d = tmp_path / "probe"
    d.mkdir()
    monkeypatch.setenv("PROBE_DIR", str(d))
    yield d
    kill_probes(d, [b"role_probe", b"node_probe"])


@pytest.fixture
def run_launcher(tmp_path, probe_dir):
    """Start ``python -m trainer.launch ARGS`` in tmp_path; stopped (and its roles killed) at teardown."""
    launchers = Launchers(tmp_path)
    yield launchers.start
    launchers.close()


@pytest.fixture(scope="session")
def criteo_file(tmp_path_factory):
    """A Criteo-format file of the CTR tests (:mod:`tests.helpers.ctr_job`), generated once."""
    from tests.helpers.ctr_job import write_criteo_file

    return write_criteo_file(tmp_path_factory.mktemp("criteo") / "train.tsv")


@pytest.fixture(scope="session")
def ctr_sync_job(tmp_path_factory, criteo_file):
    """The CTR example's sync run under ps-launch, once: tests/examples/test_ctr_example.py checks its
    training and files, tests/launch/test_console.py its console (each job costs four processes importing
    torch)."""
    from tests.helpers.ctr_job import run_ctr_job

    return run_ctr_job(tmp_path_factory.mktemp("ctr_sync"), criteo_file, "sync")
