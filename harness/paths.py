"""Where the repository is, and the PYTHONPATH that lets a child process import it from any directory."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # harness/ is one level below the repository


def pythonpath_with_repo() -> str:
    """PYTHONPATH for a child process: the repository first, so it imports ``harness``, ``benchmarks.*``
    and ``tests.*`` from any cwd.

    Also makes the child import this checkout's ``transpiler``, ``pserver`` and ``trainer``, as the
    parent itself does when run from the repository root (pytest, ``python -m benchmarks.x``).
    """
    rest = os.environ.get("PYTHONPATH")
    return os.pathsep.join([str(REPO)] + ([rest] if rest else []))
