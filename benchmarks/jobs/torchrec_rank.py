"""One rank of the peers' TorchRec job S (``shared/peers/torchrec_ctr.py``), started on its own host.

``torchrec_ctr.py`` spawns both its ranks from one process on 127.0.0.1. Across hosts each rank
is its own process in its host's network namespace; this runs the peer's own worker function
(its model, sharding plan, data and timing, unchanged) for one rank, with the rendezvous at the
first rank's host instead of 127.0.0.1, and gloo bound to the interface ``GLOO_SOCKET_IFNAME``
names. Rank 0 writes the peer's JSON result to ``--out``. Runs with TorchRec's venv python and
needs nothing of this repository::

    GLOO_SOCKET_IFNAME=eth0 torchrec-venv/bin/python benchmarks/jobs/torchrec_rank.py \\
        --peers ../shared/peers --rank R --world 2 --master 10.231.5.3 --port 29600 --out rank0.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys


class _ResultFile:
    """Stands in for the multiprocessing queue the peer's worker puts its result on."""

    def __init__(self, path: str):
        self.path = path

    def put(self, result: dict) -> None:
        with open(self.path, "w") as f:
            json.dump(result, f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--peers", required=True, help="the peers' folder (torchrec_ctr.py, jobs.py)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True, help="address of rank 0's host (the rendezvous)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True, help="rank 0 writes the result here")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--batch", type=int, default=None, help="per rank")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if not 0 <= a.rank < a.world:
        p.error(f"--rank must be in [0, {a.world}), got {a.rank}")
    import torch.distributed as dist

    # By its path: this runs in TorchRec's venv, where neither the peers' folder nor this repository is
    # importable.
    spec = importlib.util.spec_from_file_location(
        "torchrec_ctr", os.path.join(os.path.abspath(a.peers), "torchrec_ctr.py")
    )
    torchrec_ctr = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(torchrec_ctr)

    jobs = torchrec_ctr.jobs
    a.steps = jobs.S_STEPS if a.steps is None else a.steps
    a.warmup = jobs.S_WARMUP if a.warmup is None else a.warmup
    a.batch = jobs.S_BATCH // 2 if a.batch is None else a.batch
    init = dist.init_process_group

    def init_at_master(*args, **kwargs):
        # The worker sets MASTER_ADDR to 127.0.0.1 just before this call: rendezvous at rank 0's host instead.
        os.environ["MASTER_ADDR"] = a.master
        return init(*args, **kwargs)

    dist.init_process_group = init_at_master
    torchrec_ctr._worker(a.rank, a.world, a.port, a, _ResultFile(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
