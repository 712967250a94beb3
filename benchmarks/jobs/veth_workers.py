"""Worker processes of ``bench_veth.py``: job D's roles, each started inside a network namespace.

``bench_veth`` starts every role as its own OS process with ``ip netns exec NS`` (the repository
on its PYTHONPATH)::

    python -m benchmarks.jobs.veth_workers {pserver,trainer,ddp} --spec JSON --out FILE
    python -m benchmarks.jobs.veth_workers rpc --spec JSON --out FILE --rank R --world W --ps 2 \\
        --init tcp://ADDR:PORT [--transports uv] [--channels mpt_uv,basic]

``pserver``, ``trainer`` and ``ddp`` are ``dense_workers.py``'s roles (this
product's pserver and trainer from Paddle's role variables, a DDP rank over
gloo from ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), with two
changes made here, on the module, without editing it: the batches are job D's
data from the peers' ``jobs.py`` (``jobs.dense_batch(step, rank)``, the data
the torch peers train on), and the timed loop also counts the bytes of this
namespace's veth end during the timed steps.

``rpc`` is one rank of the peers' ``torch.distributed.rpc`` batch-updating
parameter server (``torch_peers.py rpc-ps-dense``): ranks ``0..ps-1`` are the
pservers ``ps<i>`` (rank 0 also drives, as in PyTorch's tutorial), the rest
the trainers. It loads ``torch_peers`` (:func:`~benchmarks.common.paths.peer_module`,
registered under that name, as RPC pickles its classes by it) and uses its parameter server class,
trainer loop, shards and result record unchanged; what differs is the start:
one process per rank (not ``mp.spawn``), a TCP rendezvous (``--init``) instead
of a shared file, and TensorPipe's transports and channels as given (none
given: TensorPipe's defaults, which on one host move tensors through shared
memory or cross-process memory reads). ``TP_SOCKET_IFNAME`` and
``GLOO_SOCKET_IFNAME`` (set by ``bench_veth.py`` to the namespace's veth or
``lo``) choose the interface TensorPipe's TCP transport binds.

Every role reads ``BENCH_VETH_COUNTERS`` (``rx_path,tx_path``: the sysfs
counters of this namespace's veth end) and reports their growth over its
timed steps as ``veth_rx_bytes`` / ``veth_tx_bytes``. ``--peers`` (or
``BENCH_PEERS_DIR``) is the directory of ``jobs.py`` and ``torch_peers.py``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Dict, Optional, Sequence

from benchmarks.common.paths import DEFAULT_PEERS, peer_module

log = logging.getLogger("veth_workers")


def peers_dir() -> str:
    """The directory of the peers' ``jobs.py`` and ``torch_peers.py`` (``BENCH_PEERS_DIR`` or
    ../shared/peers)."""
    return os.environ.get("BENCH_PEERS_DIR") or DEFAULT_PEERS


def import_jobs():
    """The peers' ``jobs`` module (job D's sizes, hyper-parameters and data)."""
    return peer_module(peers_dir(), "jobs")


def import_torch_peers():
    """The peers' ``torch_peers`` module (the torch RPC parameter server and its trainer loop)."""
    return peer_module(peers_dir(), "torch_peers")


def veth_counters() -> Dict[str, float]:
    """This namespace's veth end, bytes received and sent so far (empty without BENCH_VETH_COUNTERS)."""
    paths = os.environ.get("BENCH_VETH_COUNTERS")
    if not paths:
        return {}
    rx, tx = paths.split(",")
    with open(rx) as f_rx, open(tx) as f_tx:
        return {"veth_rx_bytes": float(f_rx.read()), "veth_tx_bytes": float(f_tx.read())}


# -- this product and DDP: dense_workers' roles on job D's data -------------------


def patch_dense_workers():
    """Make ``dense_workers`` train on ``jobs.dense_batch`` and count veth bytes in its timed loop; the
    module.

    Both patches replace module attributes that ``run_trainer`` and ``run_ddp`` look up when called, so the
    roles themselves run unchanged.
    """
    import torch

    from benchmarks.jobs import dense_workers

    jobs = import_jobs()
    timed_loop = dense_workers.timed_loop

    def make_batches(spec, rank):
        """Job D's batches of trainer ``rank``: ``jobs.dense_batch(step, rank)`` for every step."""
        if tuple(spec.sizes) != tuple(jobs.D_SIZES):
            raise ValueError(f"jobs.py's data is for sizes {jobs.D_SIZES}, the spec has {spec.sizes}")
        return [
            tuple(torch.from_numpy(a) for a in jobs.dense_batch(step, rank, spec.batch, spec.seed))
            for step in range(spec.warmup + spec.steps)
        ]

    def timed_loop_with_veth(model, batches, update, warmup, counters=dict):
        """dense_workers.timed_loop, with this namespace's veth counters among the counted ones."""
        return timed_loop(model, batches, update, warmup, lambda: {**counters(), **veth_counters()})

    dense_workers.make_batches = make_batches
    dense_workers.timed_loop = timed_loop_with_veth
    return dense_workers


# -- torch.distributed.rpc parameter server (the peer) ----------------------------


class VethWindow:
    """Reads the veth counters around the timed steps of ``torch_peers._rpc_run_trainer``.

    Installed in a trainer process, it makes ``torch_peers._dense_batches``
    return the same batches in a list whose iteration reads the counters
    just before the first timed step (index ``warmup``) and after the last
    step; the trainer loop itself is the peer's, unchanged.
    """

    def __init__(self, torch_peers):
        self.marks: Dict[str, Dict[str, float]] = {}
        make = torch_peers._dense_batches
        window = self

        class Batches(list):
            def __iter__(self):
                for i, batch in enumerate(list.__iter__(self)):
                    if i == self.warmup:
                        window.marks["start"] = veth_counters()
                    yield batch
                window.marks["end"] = veth_counters()

        def dense_batches(n, rank, batch, seed):
            out = Batches(make(n, rank, batch, seed))
            out.warmup = window.warmup
            return out

        self.warmup = 0
        torch_peers._dense_batches = dense_batches

    def deltas(self) -> Dict[str, float]:
        """The counters' growth over the timed steps (empty when not counted)."""
        start, end = self.marks.get("start", {}), self.marks.get("end", {})
        return {k: end[k] - start[k] for k in start if k in end}


_WINDOW: Optional[VethWindow] = None


def rpc_trainer(tid, ps_rrefs, shards, a, threads):
    """Run on a trainer rank by the driver: the peer's ``_rpc_run_trainer``, plus the veth bytes of its
    timed steps."""
    torch_peers = import_torch_peers()
    _WINDOW.warmup = a.warmup
    result = torch_peers._rpc_run_trainer(tid, ps_rrefs, shards, a, threads)
    return {**result, "tid": tid, **_WINDOW.deltas()}


def run_rpc(spec, args) -> Optional[dict]:
    """One rank of the torch RPC parameter server; rank 0 drives the job and returns its result record.

    The driver is ``torch_peers._rpc_worker``'s rank-0 part: it creates the
    ``BatchUpdateParameterServer`` shards on ``ps<i>``, has every trainer run
    its loop, and builds the record with ``torch_peers._dense_result``; the
    per-trainer figures (timed-step veth bytes included) are added to it.
    """
    global _WINDOW
    import numpy as np
    import torch
    import torch.distributed.rpc as rpc

    jobs = import_jobs()
    torch_peers = (
        import_torch_peers()
    )  # sets GLOO/TP_SOCKET_IFNAME=lo and MASTER_ADDR on import: put ours back
    for key in ("GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME", "MASTER_ADDR"):
        if os.environ.get("BENCH_" + key):
            os.environ[key] = os.environ["BENCH_" + key]
    n_ps, world, rank = args.ps, args.world, args.rank
    trainers = world - n_ps
    a = argparse.Namespace(
        seed=spec.seed,
        warmup=spec.warmup,
        steps=spec.steps,
        batch=spec.batch,
        trainers=trainers,
        timeout=spec.timeout,
        ps=n_ps,
    )
    if (tuple(spec.sizes), spec.lr) != (tuple(jobs.D_SIZES), jobs.D_LR):
        raise ValueError("the torch peer runs job D as jobs.py defines it (sizes, lr)")
    threads = max(1, (os.cpu_count() or 1) // trainers)  # as torch_peers.cmd_rpc_ps_dense
    torch.set_num_threads(threads)
    if rank >= n_ps:
        _WINDOW = VethWindow(torch_peers)
    options = {"init_method": args.init, "num_worker_threads": 16, "rpc_timeout": spec.timeout}
    if args.transports:
        options["_transports"] = args.transports.split(",")
    if args.channels:
        options["_channels"] = args.channels.split(",")
    name = f"ps{rank}" if rank < n_ps else f"trainer{rank - n_ps}"
    log.info(
        "%s: init_rpc rank %d/%d at %s, TP_SOCKET_IFNAME=%s, transports %s, channels %s",
        name,
        rank,
        world,
        args.init,
        os.environ.get("TP_SOCKET_IFNAME"),
        args.transports or "default",
        args.channels or "default",
    )
    rpc.init_rpc(
        name, rank=rank, world_size=world, rpc_backend_options=rpc.TensorPipeRpcBackendOptions(**options)
    )
    result = None
    if rank == 0:
        shards = torch_peers._shards(n_ps)
        ps_rrefs = [
            rpc.remote(
                f"ps{i}",
                torch_peers.BatchUpdateParameterServer,
                args=(i, n_ps, trainers, jobs.D_LR, spec.seed, threads),
            )
            for i in range(n_ps)
        ]
        futs = [
            rpc.rpc_async(f"trainer{t}", rpc_trainer, args=(t, ps_rrefs, shards, a, threads))
            for t in range(trainers)
        ]
        st = [f.wait() for f in futs]
        ps_st = [r.rpc_sync().stats() for r in ps_rrefs]
        tmax = max(s["t"] for s in st)
        result = torch_peers._dense_result(
            "rpc-ps-dense",
            a,
            tmax,
            a.steps,
            a.batch * trainers,
            {
                "procs": world,
                "n_ps": n_ps,
                "n_trainers": trainers,
                "backend": "tensorpipe",
                "transports": args.transports or "default",
                "channels": args.channels or "default",
                "per_trainer_s": [round(s["t"], 3) for s in st],
                "trainer_compute_ms_per_step": round(
                    1e3 * np.mean([s["compute_s"] for s in st]) / a.steps, 2
                ),
                "trainer_comm_wait_ms_per_step": round(
                    1e3 * np.mean([s["comm_wait_s"] for s in st]) / a.steps, 2
                ),
                "ps_rounds": [p["rounds"] for p in ps_st],
                "ps_numel": [p["numel"] for p in ps_st],
                "ps_apply_ms_per_round": [round(1e3 * p["apply_s"] / max(1, p["rounds"]), 2) for p in ps_st],
                "first_loss": round(float(np.mean([s["first"] for s in st])), 4),
                "final_loss": round(float(np.mean([s["last"] for s in st])), 4),
                "per_trainer": st,
            },
        )
        del ps_rrefs
    rpc.shutdown()
    return result


# -- driver ----------------------------------------------------------------------


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=["pserver", "trainer", "ddp", "rpc"])
    p.add_argument("--spec", required=True, help="JSON of a dense_workers.Spec")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    p.add_argument("--rank", type=int, default=0, help="rpc: this rank (0..ps-1: pservers)")
    p.add_argument("--world", type=int, default=4, help="rpc: pservers + trainers")
    p.add_argument("--ps", type=int, default=2, help="rpc: pservers (1 or 2)")
    p.add_argument("--init", help="rpc: init_method, tcp://ADDR:PORT of rank 0")
    p.add_argument(
        "--transports", default="", help="rpc: TensorPipe transports, e.g. uv (default: all viable)"
    )
    p.add_argument(
        "--channels", default="", help="rpc: TensorPipe channels, e.g. mpt_uv,basic (default: all)"
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    dense_workers = patch_dense_workers() if args.role != "rpc" else None
    from benchmarks.jobs.dense_workers import Spec, write_result

    spec = Spec.from_json(args.spec)
    t0 = time.monotonic()
    if args.role == "rpc":
        result = run_rpc(spec, args)
    else:
        if args.role != "pserver":
            import torch

            torch.set_num_threads(1)  # as dense_workers.main; pservers take theirs from the config (1)
        result = dense_workers.ROLES[args.role](spec)
    log.info("%s done in %.1f s", args.role, time.monotonic() - t0)
    if result is not None:
        write_result(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
