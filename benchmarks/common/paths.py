"""Where the benchmarks find things: the results folder, the job scripts, the peers.

The repository itself and the PYTHONPATH of a child process are :mod:`harness.paths`'s.

The peers (``../shared/peers``: the jobs' definitions and the systems users would run instead)
are not part of the repository; :func:`peer_module` loads one of their modules from its file.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from harness.paths import REPO

BENCHMARKS = os.path.join(REPO, "benchmarks")
RESULTS = os.path.join(BENCHMARKS, "results")
DEFAULT_PEERS = os.path.normpath(os.path.join(REPO, "..", "shared", "peers"))


def dated_result(benchmark: str, ext: str = "json") -> str:
    """``results/<benchmark>-<YYYY-MM-DD>.<ext>``, today's date in UTC: where a run records by default.

    Results are named by benchmark and date (``benchmarks/results/RESULTS.md`` says how), so a new run
    adds a file beside the recorded ones instead of overwriting the one RESULTS.md cites.
    """
    return os.path.join(RESULTS, f"{benchmark}-{time.strftime('%Y-%m-%d', time.gmtime())}.{ext}")


def job_script(name: str) -> str:
    """The file of job ``name`` in ``benchmarks/jobs/`` (ps-launch runs a script, not a module)."""
    return os.path.join(BENCHMARKS, "jobs", f"{name}.py")


def peer_module(peers_dir: str, name: str):
    """The peers' module ``name`` (``jobs``, ``torch_peers``) loaded from ``peers_dir/name.py``.

    Registered in ``sys.modules`` under ``name``: the peers import each other by that name and
    ``torch.distributed.rpc`` pickles their classes by it. A second call for the same file
    returns the module already loaded.
    """
    path = os.path.abspath(os.path.join(peers_dir, f"{name}.py"))
    loaded = sys.modules.get(name)
    if loaded is not None and os.path.abspath(getattr(loaded, "__file__", "") or "") == path:
        return loaded
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no {name}.py in {peers_dir!r}: pass --peers DIR (the peers' folder)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
