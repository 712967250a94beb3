"""Fixtures shared by the test modules."""
from __future__ import annotations

from typing import List

import pytest

from tests.helpers.jobs import Job


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
