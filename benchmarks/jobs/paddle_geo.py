"""PaddlePaddle 2.6's GEO mode on job S: the peers' ``paddle_ps_ctr.py`` with ``k_steps`` set.

The peers' script runs Paddle's sync and async modes; GEO is its async mode with
``strategy.a_sync_configs = {"k_steps": K}``, so this wrapper runs that script
unchanged except for that one setting: the strategy it builds sets ``k_steps``
whenever it turns ``a_sync`` on. Run it with Paddle's Python, as the script::

    /tmp/paddle26-venv/bin/python benchmarks/jobs/paddle_geo.py --k_steps 4 --peers ../shared/peers \\
        --mode async --data jobs --trainers 4 --servers 2 --out geo.json

Every other argument is ``paddle_ps_ctr.py``'s. Its role processes run this file
again (``--role-proc``), so each applies the setting too.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def _load(peers: str, name: str):
    """The peers' module ``name`` from ``peers/name.py``, registered under that name (the script imports
    ``jobs``)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(peers, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--k_steps", type=int, required=True)
    p.add_argument("--peers", required=True)
    ours, rest = p.parse_known_args(argv)
    if ours.k_steps < 1:
        p.error("--k_steps must be >= 1 (GEO)")
    peers = os.path.abspath(ours.peers)
    _load(peers, "jobs")  # the script imports it by name, as found next to itself
    from paddle.distributed import fleet

    base = fleet.DistributedStrategy

    class GeoStrategy(base):
        """Paddle's strategy whose async mode is GEO with ``k_steps``."""

        @property
        def a_sync(self):
            return base.a_sync.fget(self)

        @a_sync.setter
        def a_sync(self, value):
            base.a_sync.fset(self, value)
            if value:
                self.a_sync_configs = {"k_steps": ours.k_steps}

    fleet.DistributedStrategy = GeoStrategy
    script = _load(peers, "paddle_ps_ctr")
    # Its launcher starts each role as ``python <its __file__> --role-proc ...``: this file, with our
    # arguments.
    script.__file__ = os.path.abspath(__file__)
    os.environ["PADDLE_GEO_ARGS"] = f"--k_steps {ours.k_steps} --peers {peers}"
    return script.main(rest)


if __name__ == "__main__":
    if "--role-proc" in sys.argv and "--k_steps" not in sys.argv:  # a role started by the script's launcher
        sys.argv[1:1] = os.environ["PADDLE_GEO_ARGS"].split()
    sys.exit(main())
