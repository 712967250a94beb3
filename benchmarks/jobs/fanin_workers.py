"""Processes of the emulated fan-in: a pserver, and a load generator that runs many emulated trainers.

``benchmarks.bench_fanin`` starts each as its own OS process::

    python -m benchmarks.jobs.fanin_workers pserver --spec FILE --index I
    python -m benchmarks.jobs.fanin_workers load --spec FILE --index G --of N

A load generator runs trainers ``G, G + N, G + 2N, ...`` of the spec's K. Each emulated trainer is a
real trainer session speaking the wire through the trainer's own client code: its own
:class:`~trainer.transport.Channels` (so its own gRPC channel, and TCP connection, to every pserver:
the channel options keep a local subchannel pool), its own Hello and session, its own heartbeats
(one :class:`~trainer.heartbeat.Heartbeat` thread of the load generator sends every trainer's, each on
its own account, as a trainer's thread would), and each step pushes to every pserver as a trainer's
``Transfers.push_all`` does (each push sent on its open data connection, then the answers read; the
others one ``PserverChannel.push_pull`` each, run in parallel by ``Channels.run_parallel``), then Close.
Its table gradients are routed by a :class:`~trainer.embedding.client.TableClient`, which also sends
the next batch's ids with the push (``<table>@next``, job S's fast path: the answer brings their rows).
What is not emulated is the model: no forward or backward runs; the gradients come from
:mod:`benchmarks.jobs.fanin_job`, a function of (trainer, step). Each emulated trainer has one
driver thread here (a real trainer's main thread) and the threads its Channels start.

The processes of a run meet through files in the spec's ``run_dir``: a load generator says Hello for
its trainers when ``hello`` appears, writes ``hello-G`` once they all have sessions, steps when ``go``
appears (sync: trainer 0 first reads the initial model for the check, one pull and one prefetch per
pserver: no step applies before its first push), writes ``stepped-G`` when its trainers are done, and
when ``finish`` appears (sync: trainer 0 reads the model after the last step), closes every session and
writes ``result-G.pt``: per push its pserver, step, start and end (``time.monotonic()``, one clock
for every process of the host), and the models read. Every wait has the spec's deadline.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import logging
import os
import sys
import threading
import time
from concurrent import futures
from typing import Dict, List, Optional, Tuple

import torch

from benchmarks.jobs.fanin_job import Spec, batch_ids, check_ids, dense_gradients, sparse_rows, transpiler
from benchmarks.jobs.job_s_program import TABLE

log = logging.getLogger("benchmarks.fanin")

# How many of a load generator's trainers make their step's gradients at once. A real trainer makes them
# on a host of its own; hundreds of threads making them at once in one process would starve its heartbeat
# thread of the interpreter lock for longer than heartbeat_timeout, and the pservers would drop trainers
# that live (the emulator's limit, not the pservers').
MAKING_GRADIENTS = threading.BoundedSemaphore(4)


def wait_for_file(path: str, deadline: float, what: str) -> None:
    """Return once ``path`` exists; TimeoutError naming ``what`` at ``deadline`` (monotonic)."""
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: {path} did not appear in time")
        time.sleep(0.01)


def touch(path: str) -> None:
    """Create ``path`` whole (written aside, then renamed), so a reader never sees it half made."""
    with open(path + ".tmp", "w"):
        pass
    os.replace(path + ".tmp", path)


class Answer:
    """Where a push-pull's or a pull's answer lands: new tensors, by name (blocks, and rows asked ahead)."""

    def __init__(self, blocks: Dict[str, Tuple[str, list]], rows: Dict[str, Tuple[str, list]]):
        self._shapes = {**blocks, **rows}
        self.tensors: Dict[str, torch.Tensor] = {}

    def dtype_and_shape(self, name: str) -> Optional[Tuple[str, list]]:
        return self._shapes.get(name)

    def __call__(self, name: str) -> torch.Tensor:
        dtype, shape = self._shapes[name]
        self.tensors[name] = torch.empty(shape, dtype=getattr(torch, dtype))
        return self.tensors[name]


class EmulatedTrainer:
    """One trainer session of ``program`` (see the module doc): Hello, ``step(s)``, the check reads, Close."""

    def __init__(self, spec: Spec, program):
        from trainer.embedding.client import TableClient
        from trainer.recovery import Recovery
        from trainer.transport import Channels

        self.spec, self.program, self.trainer_id = spec, program, program.trainer_id
        self.channels = Channels(program)
        cfg = program.config
        # A pserver killed and restarted mid-run: the trainer's own recovery (wait, Hello, roll back, go on).
        self.recovery = Recovery(
            self.channels, spec.sync_mode, program.pservers, cfg.connect_timeout, cfg.recovery_timeout
        )
        self.blocks = {b.name: (b.dtype, b.shape) for b in program.blocks}
        self.by_endpoint = {ep: [b for b in program.blocks if b.endpoint == ep] for ep in program.pservers}
        self.tables = TableClient(program.tables, program.pservers, self._fetch, lambda: self._min_step)
        self._min_step = 0
        self.pushes: List[Tuple[int, int, float, float]] = []  # (pserver index, step, start, end)

    def hello(self, heartbeat) -> None:
        """Open this trainer's sessions, then have ``heartbeat`` (its process's Heartbeat thread) keep
        them."""
        replies = self.channels.hello(self.spec.timeout)
        starts = {r.start_step for r in replies.values()}
        if starts != {0}:
            raise RuntimeError(
                f"trainer {self.trainer_id}: pservers start it at steps {sorted(starts)}, not 0"
            )
        self.recovery.incarnations = {ep: r.incarnation for ep, r in replies.items()}
        heartbeat.add(self.channels)

    def train(self, in_step) -> None:
        """Every step in order, each inside ``in_step``; a step whose calls fail re-syncs as a trainer does
        (:meth:`trainer.recovery.Recovery.heal`) and goes on from the step its decision names (a roll-back:
        the checkpoint's; the steps' gradients are a function of the step, so redone steps push the same)."""
        step = 0
        while step < self.spec.steps:
            with in_step:
                moved = self.recovery.heal(
                    step, f"step {step}", functools.partial(self.step, step), lambda at: None
                )
            step = step + 1 if moved is None else moved.step

    def step(self, step: int) -> None:
        """Push ``step``'s gradients to every pserver (with the next batch's ids) and receive the answers."""
        with MAKING_GRADIENTS:
            ids = batch_ids(self.spec, self.trainer_id, step)
            sparse = self.tables.route_gradients(
                {TABLE: (ids, sparse_rows(self.spec, self.trainer_id, step, ids))}
            )
            ask = None
            if step + 1 < self.spec.steps:
                plan = self.tables.plan_next_batch({TABLE: batch_ids(self.spec, self.trainer_id, step + 1)})
                ask = self.tables.ask_next_batch(plan)
            dense = dense_gradients(self.spec, self.program.blocks, self.trainer_id, step)
        jobs, started = {}, {}
        for k, ep in enumerate(self.program.pservers):
            tensors = (
                [(b.name, dense[b.name]) for b in self.by_endpoint[ep]]
                + sparse[ep]
                + (ask.ids.get(ep, []) if ask is not None else [])
            )
            rows = ask.rows.get(ep, {}) if ask is not None else {}
            answer = Answer({b.name: (b.dtype, b.shape) for b in self.by_endpoint[ep]}, rows)
            # As Transfers.push_all: over an open data connection, sent now and its answer read below.
            start = time.monotonic()
            call = self.channels[ep].start_push_pull(step, tensors, answer, (0, step + 1))
            if call is not None:
                started[k] = (call, start)
            else:
                jobs[ep] = functools.partial(self._push, k, ep, step, tensors, answer, rows)
        from trainer.transport import answered_first

        try:
            self.channels.run_parallel(jobs)
            while started:  # as they arrive, as Transfers.push_all reads them
                k = answered_first({k: call for k, (call, _) in started.items()})
                call, start = started.pop(k)
                call.finish()
                self.pushes.append((k, step, start, time.monotonic()))
        finally:
            for call, _ in started.values():  # a failed step: the calls left are given up (healing resends)
                call.abandon()
            self.tables.clear()

    def _push(self, k: int, endpoint: str, step: int, tensors, answer: Answer, rows) -> None:
        answer_bytes = sum(b.nbytes for b in self.by_endpoint[endpoint]) + sum(
            torch.Size(shape).numel() * 4 for _, shape in rows.values()
        )
        start = time.monotonic()
        self.channels[endpoint].push_pull(
            step, tensors, answer.dtype_and_shape, answer, (0, step + 1), answer_bytes=answer_bytes
        )
        self.pushes.append((k, step, start, time.monotonic()))

    def _fetch(self, fetch, min_step: int):
        """Rows of a RowFetch, one prefetch per pserver (what the TableClient's reads call)."""
        return self.channels.run_parallel(
            {
                ep: functools.partial(self.channels[ep].prefetch, min_step, fetch.ids[ep], fetch.rows[ep].get)
                for ep in fetch.ids
            }
        )

    def read_model(self, min_step: int) -> Dict[str, torch.Tensor]:
        """The dense blocks and the check ids' rows once every pserver applied ``min_step`` updates."""
        answers = {}
        for ep, blocks in self.by_endpoint.items():
            if blocks:
                answer = Answer(self.blocks, {})
                self.channels[ep].pull([b.name for b in blocks], min_step, answer.dtype_and_shape, answer)
                answers.update(answer.tensors)
        self._min_step = min_step
        answers["@rows"] = self.tables.pull_rows(TABLE, torch.from_numpy(check_ids(self.spec)))
        self.tables.clear()
        return answers

    def close(self) -> None:
        left = self.channels.close(self.spec.timeout)
        if any(n < 0 for n in left.values()):
            raise RuntimeError(f"trainer {self.trainer_id}: Close was not answered by {left}")


def stepping(spec: Spec):
    """What a load generator's trainer holds while inside a step: a bound of ``spec.in_flight`` (async) or
    nothing.

    Async trainers do not wait for each other, so a bound only spreads their steps out in time, as their
    own forward and backward would on hosts of their own. Without it, at K = 1,024 on this 2-core machine
    every trainer of a load generator is inside a step at once, its ~1,000 threads take turns at one
    interpreter lock, and its heartbeats left up to 40 s late while the pservers' event loops lagged at
    most 3.8 s: the emulator starved itself, not the pservers (issue 34's sixth part,
    benchmarks/results/history/2026-11-28-issue-34-async-k1024.md). A sync step needs every trainer's
    push at once: no bound there.
    """
    if spec.in_flight and not spec.sync_mode:
        return threading.BoundedSemaphore(spec.in_flight)
    return contextlib.nullcontext()


def run_load(spec: Spec, index: int, of: int) -> None:
    """Run trainers ``index, index + of, ...`` of ``spec`` (see the module doc); write
    ``result-<index>.pt``."""
    from trainer.heartbeat import Heartbeat

    deadline = time.monotonic() + spec.timeout
    program = transpiler(spec).get_trainer_program()
    ids = range(index, spec.trainers, of)
    trainers = [EmulatedTrainer(spec, dataclasses.replace(program, trainer_id=k, model=None)) for k in ids]
    # One driver thread per emulated trainer (a trainer's main thread); pushes run on its Channels' threads.
    pool = futures.ThreadPoolExecutor(max_workers=len(trainers), thread_name_prefix="emulated")
    # One heartbeat thread for them all: a thread each would starve on this process's share of the machine,
    # where a real trainer's has a host of its own, and the pservers would drop trainers that live.
    heartbeat = Heartbeat(
        [], program.pservers, program.config.heartbeat_interval, program.config.heartbeat_timeout
    ).start()
    models: Dict[str, Dict[str, torch.Tensor]] = {}
    try:
        wait_for_file(os.path.join(spec.run_dir, "hello"), deadline, f"load generator {index}")
        for f in futures.as_completed(
            [pool.submit(t.hello, heartbeat) for t in trainers], timeout=spec.timeout
        ):
            f.result()
        checker = trainers[0] if index == 0 and spec.sync_mode else None
        touch(os.path.join(spec.run_dir, f"hello-{index}"))
        wait_for_file(os.path.join(spec.run_dir, "go"), deadline, f"load generator {index}")

        in_step = stepping(spec)

        def train(t: EmulatedTrainer) -> None:
            if (
                t is checker
            ):  # sync: no step applies before this trainer's first push, so this is the initial model
                models["initial"] = checker.read_model(0)
            t.train(in_step)

        remaining = max(1.0, deadline - time.monotonic())
        for f in futures.as_completed([pool.submit(train, t) for t in trainers], timeout=remaining):
            f.result()
        touch(os.path.join(spec.run_dir, f"stepped-{index}"))
        wait_for_file(os.path.join(spec.run_dir, "finish"), deadline, f"load generator {index}")
        if checker is not None:
            models["final"] = checker.read_model(spec.steps)
        heartbeat.stop()
        for f in futures.as_completed([pool.submit(t.close) for t in trainers], timeout=spec.timeout):
            f.result()
    except BaseException:
        heartbeat.stop()
        for t in trainers:  # no Close: the pservers must not count a failed run's trainers as done
            t.channels.shutdown()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    pushes = [(t.trainer_id, *p) for t in trainers for p in t.pushes]
    path = os.path.join(spec.run_dir, f"result-{index}.pt")
    torch.save({"pushes": pushes, "models": models}, path + ".tmp")
    os.replace(path + ".tmp", path)


def run_pserver(spec: Spec, index: int, replica: bool = False) -> None:
    """Serve pserver ``index`` of ``spec`` (``replica``: the second process of its shard) until every trainer
    has closed (or SIGTERM)."""
    from pserver import ParameterServer

    t = transpiler(spec)
    endpoint = spec.replica_endpoints[index] if replica else spec.pservers[index]
    ps_program = t.get_pserver_program(endpoint)
    ParameterServer(ps_program, t.get_startup_program(endpoint, ps_program)).serve()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("role", choices=["pserver", "load"])
    p.add_argument("--spec", required=True, help="file holding the Spec's JSON")
    p.add_argument("--index", type=int, required=True, help="the pserver's, or the load generator's, index")
    p.add_argument("--of", type=int, default=1, help="load generators in all")
    p.add_argument("--replica", action="store_true", help="pserver: the shard's second process (hot standby)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)  # many processes share this machine's cores
    with open(args.spec) as f:
        spec = Spec.from_json(f.read())
    if args.role == "pserver":
        run_pserver(spec, args.index, args.replica)
    else:
        run_load(spec, args.index, args.of)
    return 0


if __name__ == "__main__":
    code = main()
    # The result is written: spare the exit the interpreter's last collection over the ~370k objects of
    # torch, dynamo and numba (2-6 s on a loaded 2-core machine, which the benchmark waits for).
    gc.freeze()
    sys.exit(code)
