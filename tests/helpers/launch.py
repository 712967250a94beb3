"""Running ``ps-launch`` from a test."""
from __future__ import annotations

import subprocess
import sys


def run_ps_launch(args, cwd, timeout: float) -> subprocess.CompletedProcess:
    """``python -m trainer.launch ARGS`` in ``cwd``; SIGTERM (which stops its roles) on timeout."""
    argv = [sys.executable, "-m", "trainer.launch", *args]
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the launcher stops its roles on SIGTERM
            out, err = proc.communicate(timeout=20)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)
