"""Waiting for a condition that other threads or processes make true, with a deadline."""

from __future__ import annotations

import time
from typing import Callable, TypeVar

T = TypeVar("T")


def poll(ready: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """Call ``ready`` every 50 ms until it returns something truthy, and return that.

    Raises AssertionError naming ``what`` if ``timeout`` seconds pass first.
    """
    deadline = time.monotonic() + timeout
    while True:
        got = ready()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout}s")
        time.sleep(0.05)
