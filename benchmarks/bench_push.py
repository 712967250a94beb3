"""Job S's pushes served in one process: a pserver's CPU per push, phase by phase, without the noise of a job.

    python -m benchmarks.bench_push [--modes async,sync] [--steps 600] [--peers ../shared/peers]

Pserver 0 of job S (2 pservers x 2 trainers, ``jobs/job_s.py``'s program, default configuration) is
built as ``ps-launch`` builds it, but not started: no socket, reactor or other process. Trainer ``r``'s
push at step ``t`` carries random dense gradients of the pserver's blocks, the gradients of its batch's
distinct ids on shard 0 (``jobs.ctr_batch(t * 2 + r)``, about 3,090, a third of them new) and its next
batch's ids, written by the trainer's own :class:`~trainer.transport.data.payloads.PserverPayloads`.
The pserver serves it as the data channel serves a shared push (``ChannelCalls._push_pull``, less the
reactor, the session checks and the counters of calls in progress): **read**
(:meth:`pserver.data.parts.Payloads.push`: the layout, the checks, the views), **count**
(:meth:`pserver.rpc.service.data_calls.DataCalls.count_push`: async, the engine's apply; sync, the step's
sums, and the step's apply on the push that completes it), **answer** (the blocks copied whole and the
next batch's rows looked up into the answer's buffer). Sync serves both pushes of a step, then both
answers. 20 warm-up steps, then ``--steps`` timed: the table grows as in the job.

Figures are thread CPU (``time.thread_time``) per push: median [quartiles] over the timed pushes. A job's
pserver costs more than this (``step_breakdown``: its reactor, sockets and system calls, and caches
shared with the trainers on the same cores); what this isolates is the work of a push itself. To
compare two trees, run it from each, alternating, several times: on a shared 2-core machine runs of one
tree still differ by about a tenth (a job's CPU per push by a fifth).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Dict, List, Tuple

import numpy as np
import torch

from benchmarks.common.paths import DEFAULT_PEERS, peer_module
from benchmarks.jobs.job_s_program import TABLE, build_program, shard_batch_ids
from pserver import ParameterServer
from pserver.data.calls import PushHead
from pserver.data.parts import Payloads
from psproto.security import Security
from trainer.transport.data.payloads import PserverPayloads
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

TRAINERS, PSERVERS, WARMUP, BATCH = 2, 2, 20, 512
PHASES = ("read", "count", "answer")


class Replay:
    """Pserver 0 of job S, built and not started, and what trainers' pushes to it carry."""

    def __init__(self, jobs, sync: bool):
        self.jobs = jobs
        endpoints = [f"127.0.0.1:{port}" for port in range(1, PSERVERS + 1)]  # never bound: not started
        t = DistributeTranspiler(DistributeTranspilerConfig())
        t.transpile(
            0, program=build_program(jobs), pservers=",".join(endpoints), trainers=TRAINERS, sync_mode=sync
        )
        program = t.get_pserver_program(endpoints[0])
        self.server = ParameterServer(
            program, t.get_startup_program(endpoints[0], program), security=Security()
        )
        self.data = self.server.servicer.data
        self.engine = self.server.engine
        self.payloads = Payloads(self.data.contents, allow_nonfinite=False)
        trainer = t.get_trainer_program()
        self.blocks = [b for b in trainer.blocks if b.endpoint == endpoints[0]]
        self.table = next(s for s in trainer.tables if s.name == TABLE)
        self.writer = PserverPayloads(self.blocks, trainer.tables)
        self.out = np.empty(8 << 20, np.uint8)  # the answer region
        self.rng = np.random.default_rng(0)
        for trainer_id in range(TRAINERS):
            self.engine.hello(trainer_id)

    def close(self) -> None:
        """Stop the pserver (never started: this releases the data port it bound)."""
        self.server.stop()

    def _ids(self, index: int) -> np.ndarray:
        return shard_batch_ids(self.jobs, index, PSERVERS, batch=BATCH)

    def payload(self, trainer_id: int, step: int):
        """(the push's bytes, its gradient wire dtype) of ``trainer_id`` at ``step``."""
        ids = self._ids(step * TRAINERS + trainer_id)
        tensors = [
            (b.name, torch.from_numpy(self.rng.standard_normal(b.shape, np.float32) * 1e-3))
            for b in self.blocks
        ]
        tensors += [
            (self.table.ids_name, torch.from_numpy(ids)),
            (
                self.table.rows_name,
                torch.from_numpy(self.rng.standard_normal((ids.size, self.table.dim), np.float32) * 1e-3),
            ),
            (self.table.next_name, torch.from_numpy(self._ids((step + 1) * TRAINERS + trainer_id))),
        ]
        push = self.writer.plan_push(tensors, 1, 0, dropped=False)
        out = np.empty(push.layout.nbytes, np.uint8)
        self.writer.write_push(out, push, 1, 0)
        return out, push.grad_dtype

    def push(
        self, trainer_id: int, step: int, payload: np.ndarray, grad_dtype: int
    ) -> Tuple[Dict[str, float], Dict[str, np.ndarray]]:
        """Read and count one push; (thread CPU s of each phase, the ids its answer asks for)."""
        t0 = time.thread_time()
        parts, nbytes = self.payloads.push(payload, 1, 0, grad_dtype, False)
        t1 = time.thread_time()
        head = PushHead(trainer_id, step, 0, step, "", 0, 0, 1, (), False)
        counting = self.data.count_push(head, parts.dense, parts.sparse, nbytes)
        try:
            next(counting)
            raise RuntimeError("a push parked: the replay never waits")
        except StopIteration as done:
            assert done.value, "a push was not counted"
        t2 = time.thread_time()
        return {"read": t1 - t0, "count": t2 - t1}, parts.answer_ids

    def answer(self, trainer_id: int, min_step: int, answer_ids) -> float:
        """Write one push's answer in place; its thread CPU s."""
        t0 = time.thread_time()
        assert self.engine.park_for_step(trainer_id, min_step) is None, "the answer's step is not applied"
        start = self.payloads.lane(1, 0).layout.nbytes
        self.engine.read_flat_into(self.out[:start])
        self.payloads.lookup_into(self.out, start, answer_ids)
        return time.thread_time() - t0

    def run(self, steps: int) -> List[Dict[str, float]]:
        """Every step's pushes and answers; the timed pushes' phases (thread CPU s)."""
        timed = []
        for step in range(WARMUP + steps):
            served = []
            for trainer_id in range(TRAINERS):
                payload, wire = self.payload(trainer_id, step)
                phases, ids = self.push(trainer_id, step, payload, wire)
                served.append((trainer_id, phases, ids))
            for trainer_id, phases, ids in served:  # sync: the step is applied once both pushes are counted
                phases["answer"] = self.answer(trainer_id, self.engine.mode.answer_step(step), ids)
                if step >= WARMUP:
                    timed.append(phases)
        return timed


def summary(timed: List[Dict[str, float]]) -> Dict[str, List[float]]:
    """Each phase's and the whole push's median and quartiles, in ms."""
    out = {}
    for name in (*PHASES, "push"):
        values = [1e3 * (sum(p.values()) if name == "push" else p[name]) for p in timed]
        q = statistics.quantiles(values, n=4)
        out[name] = [statistics.median(values), q[0], q[2]]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--modes", default="async,sync", help="comma-separated: async, sync (default: %(default)s)"
    )
    p.add_argument("--steps", type=int, default=600, help="timed steps (default %(default)s)")
    p.add_argument("--peers", default=DEFAULT_PEERS, help="the peers' folder (default: %(default)s)")
    p.add_argument("--json", default=None, help="append the figures to this file")
    args = p.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or set(modes) - {"async", "sync"}:
        p.error(f"--modes takes async and sync, got {args.modes!r}")
    if args.steps < 4:
        p.error("--steps must be at least 4")
    torch.set_num_threads(1)
    jobs = peer_module(args.peers, "jobs")
    for mode in modes:
        replay = Replay(jobs, sync=mode == "sync")
        try:
            figures = summary(replay.run(args.steps))
        finally:
            replay.close()
        cells = ", ".join(f"{n} {m:.3f} [{lo:.3f}-{hi:.3f}]" for n, (m, lo, hi) in figures.items())
        print(f"{mode}: thread CPU ms per push: {cells}", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"mode": mode, "steps": args.steps, "ms_per_push": figures}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
