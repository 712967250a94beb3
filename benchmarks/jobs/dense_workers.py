"""Worker processes of the dense-MLP benchmark: a DDP rank, a pserver, a trainer.

``benchmarks.common.dense_runs`` starts each role as its own OS process::

    python -m benchmarks.jobs.dense_workers {ddp,pserver,trainer} --spec JSON --out FILE

``--spec`` is the JSON of a :class:`Spec` (model sizes, batch, steps, mode...).
The DDP rank reads ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``; the
pserver and trainer read Paddle's role variables (``TRAINING_ROLE``,
``PADDLE_PSERVERS_IP_PORT_LIST``, ``PADDLE_TRAINERS_NUM``, ``PADDLE_TRAINER_ID``,
``POD_IP``, ``PADDLE_PORT``), as in a real job. A trainer that is one local
process of a trainer node also reads ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` (the node's own rendezvous), as the Trainer
does; ``PADDLE_TRAINER_ID`` is then the node's id. Every DDP rank or trainer
process trains on the data of its global index (the DDP rank; for a trainer
``node * LOCAL_WORLD_SIZE + LOCAL_RANK``), so the same index sees the same
batches in every configuration. A DDP rank or a trainer writes its timings to
``--out`` as JSON; a pserver writes its CPU time once all trainers have
closed. Both sides share the model, data and timing loop below, so the only
difference between them is how the update is done.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import nn

from benchmarks.common.paths import peer_module


@dataclass
class Spec:
    """One benchmark job: model, data, optimizer, step counts and PS mode.

    ``sizes`` are the layer widths (input, hidden..., classes); ``batch`` is
    per worker; ``warmup`` steps run before the ``steps`` that are timed.
    ``sync_mode`` only matters to the parameter-server roles; ``timeout`` (s)
    bounds every wait a worker does on its own (DDP init and collectives).
    ``peers``: the folder of the peers' ``jobs.py``; when set, every worker
    trains on job D's data (``jobs.dense_batch``), as the peers do.
    """

    sizes: Tuple[int, ...] = (512, 2048, 2048, 2048, 10)
    batch: int = 256
    warmup: int = 3
    steps: int = 20
    lr: float = 0.01
    seed: int = 0
    sync_mode: bool = True
    timeout: float = 600.0
    # Folder of the peers' jobs.py: when set, batches are job D's (jobs.dense_batch), else random.
    peers: Optional[str] = None
    # The PS roles' DistributeTranspilerConfig.grad_wire_dtype (None: the default, gradients as computed).
    grad_wire_dtype: Optional[str] = None
    # The PS trainers' DistributeTranspilerConfig.shared_memory (same-host payloads; the default).
    shared_memory: bool = True
    # The PS trainers' DistributeTranspilerConfig.push_lanes (connections a large push-pull is split across).
    push_lanes: int = 1

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        data = json.loads(text)
        data["sizes"] = tuple(data["sizes"])
        return cls(**data)


# -- shared by both systems ---------------------------------------------------


def build_model(sizes: Sequence[int], seed: int) -> nn.Sequential:
    """The MLP: Linear/ReLU pairs through ``sizes``, no ReLU after the last layer.

    Seeded, so every process (DDP ranks, pservers, trainers) builds the same
    initial weights.
    """
    torch.manual_seed(seed)
    layers: List[nn.Module] = []
    for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        if i:
            layers.append(nn.ReLU())
        layers.append(nn.Linear(n_in, n_out))
    return nn.Sequential(*layers)


def param_bytes(sizes: Sequence[int]) -> int:
    """float32 bytes of the MLP's parameters (weights and biases)."""
    return 4 * sum(n_in * n_out + n_out for n_in, n_out in zip(sizes[:-1], sizes[1:]))


def make_batches(spec: Spec, rank: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """``warmup + steps`` synthetic batches for worker ``rank``: random inputs and labels.

    Generated up front from a seed that depends on ``rank`` only, so DDP rank
    r and trainer r see exactly the same data and no generation cost falls in
    the timed loop. With ``spec.peers``, the batches are job D's instead:
    ``jobs.dense_batch(step, rank, batch, seed)`` (inputs labelled by a fixed teacher).
    """
    if spec.peers:
        jobs = peer_module(spec.peers, "jobs")
        return [
            tuple(torch.from_numpy(a) for a in jobs.dense_batch(step, rank, spec.batch, spec.seed))
            for step in range(spec.warmup + spec.steps)
        ]
    g = torch.Generator().manual_seed(1000 + 7919 * spec.seed + rank)
    n_in, n_classes = spec.sizes[0], spec.sizes[-1]
    return [
        (torch.randn(spec.batch, n_in, generator=g), torch.randint(0, n_classes, (spec.batch,), generator=g))
        for _ in range(spec.warmup + spec.steps)
    ]


def cpu_clocks() -> Dict[str, float]:
    """CPU seconds so far: the process, all threads (``cpu_s``), of it in the kernel
    (``sys_s``), and the calling thread alone (``main_cpu_s``)."""
    return {"cpu_s": time.process_time(), "sys_s": os.times().system, "main_cpu_s": time.thread_time()}


def timed_loop(
    model: nn.Module,
    batches,
    update: Callable[[], object],
    warmup: int,
    counters: Callable[[], Dict[str, float]] = dict,
) -> dict:
    """Train on ``batches``: forward + cross-entropy + backward, then ``update()``.

    The first ``warmup`` steps are not timed. For the rest it returns the
    wall time from the start of the first timed step to the end of the last,
    the time spent in forward/backward (``compute_s``) and in ``update()``
    (``update_s``), every step's loss, and how much each of
    :func:`cpu_clocks` and ``counters()`` (e.g. bytes pushed) grew over the
    timed steps. CPU not in the main thread is communication: gRPC or gloo.
    """
    model.train()
    compute = update_time = 0.0
    losses: List[float] = []
    start = before = None
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            before = {**counters(), **cpu_clocks()}
            start = time.perf_counter()
            compute = update_time = 0.0
        t0 = time.perf_counter()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        t1 = time.perf_counter()
        update()
        t2 = time.perf_counter()
        compute += t1 - t0
        update_time += t2 - t1
        losses.append(loss.item())
    wall = time.perf_counter() - start
    after = {**counters(), **cpu_clocks()}
    return {
        "wall_s": wall,
        "compute_s": compute,
        "update_s": update_time,
        "steps": len(batches) - warmup,
        "losses": losses,
        **{k: after[k] - before[k] for k in after},
    }


# -- DDP over gloo -----------------------------------------------------------


def run_ddp(spec: Spec) -> dict:
    """One DDP rank over gloo: SGD on its own batches, grads all-reduced in backward."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=spec.timeout))
    try:
        model = DistributedDataParallel(build_model(spec.sizes, spec.seed))
        opt = torch.optim.SGD(model.parameters(), lr=spec.lr)

        def update():
            opt.step()
            opt.zero_grad(set_to_none=True)

        result = timed_loop(model, make_batches(spec, rank), update, spec.warmup)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    return {"rank": rank, **result}


# -- parameter server ----------------------------------------------------------


def transpile(spec: Spec, env):
    """The job's DistributeTranspiler for this role: SGD program, default config but for the wire dtype,
    shared memory and lanes."""
    from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program

    program = Program(build_model(spec.sizes, spec.seed), "sgd", lr=spec.lr)
    t = DistributeTranspiler(
        DistributeTranspilerConfig(
            grad_wire_dtype=spec.grad_wire_dtype, shared_memory=spec.shared_memory, push_lanes=spec.push_lanes
        )
    )
    t.transpile(
        env.trainer_id,
        program=program,
        pservers=env.pserver_list,
        trainers=env.trainers,
        sync_mode=spec.sync_mode,
    )
    return t


def run_pserver(spec: Spec) -> dict:
    """Serve this pserver's blocks until every trainer has closed (or SIGTERM).

    Returns the process CPU time spent while serving (``cpu_s``, of it
    ``sys_s`` in the kernel: warmup and timed steps, start-up excluded).
    """
    from pserver import ParameterServer
    from transpiler import RoleEnv

    env = RoleEnv.from_env()
    t = transpile(spec, env)
    ps_program = t.get_pserver_program(env.current_endpoint)
    server = ParameterServer(ps_program, t.get_startup_program(env.current_endpoint, ps_program))
    before = cpu_clocks()
    server.serve()
    after = cpu_clocks()
    return {
        "endpoint": env.current_endpoint,
        "cpu_s": after["cpu_s"] - before["cpu_s"],
        "sys_s": after["sys_s"] - before["sys_s"],
    }


class PhaseTimer:
    """Times the step calls a Trainer makes through its pserver channels (``tr.channels``).

    Benchmark instrumentation only: it wraps ``push_pull`` on each channel
    instance (nothing in the library changes), so it follows its current
    signature (``push_pull(step, tensors, dtype_and_shape, decode_into, ...)``,
    ``dtype_and_shape`` called once per tensor as it arrives). Times are summed over the parallel
    per-pserver calls: ``push_wait_s``, from the call until the first tensor
    of the answer is read (the push, and in sync mode the barrier wait for
    the other trainers, and the update); ``pull_recv_s``, the rest of the answer. A push over an open data
    connection (``start_push_pull``: sent, its answer read later) and any push on the data channel have no
    per-tensor mark: their whole time, from the send until the answer is read, is ``push_wait_s``.
    """

    def __init__(self, channels, endpoints):
        self.totals = {"push_wait_s": 0.0, "pull_recv_s": 0.0}
        self._lock = threading.Lock()
        for ep in endpoints:
            channels[ep].push_pull = self._timed(channels[ep].push_pull)
            channels[ep].start_push_pull = self._timed_start(channels[ep].start_push_pull)

    def _timed_start(self, start_push_pull):
        def timed_start(*args, **kwargs):
            t0 = time.perf_counter()
            started = start_push_pull(*args, **kwargs)
            if started is None:
                return None
            finish = started.finish

            def timed_finish():
                try:
                    return finish()
                finally:
                    self._add(push_wait_s=time.perf_counter() - t0)

            started.finish = timed_finish
            return started

        return timed_start

    def _timed(self, push_pull):
        def timed_push_pull(step, tensors, dtype_and_shape, decode_into, *args, **kwargs):
            t0 = time.perf_counter()
            first: List[float] = []

            def dtype_and_shape_noted(name):
                if not first:
                    first.append(time.perf_counter())
                return dtype_and_shape(name)

            try:
                return push_pull(step, tensors, dtype_and_shape_noted, decode_into, *args, **kwargs)
            finally:
                t2 = time.perf_counter()
                t1 = first[0] if first else t2
                self._add(push_wait_s=t1 - t0, pull_recv_s=t2 - t1)

        return timed_push_pull

    def _add(self, **seconds: float) -> None:
        with self._lock:
            for k, v in seconds.items():
                self.totals[k] += v

    def snapshot(self) -> Dict[str, float]:
        with self._lock:
            return dict(self.totals)


def time_node_collectives(group, totals: Dict[str, float]) -> None:
    """Add the time spent in a node's collectives to ``totals["node_coll_s"]``.

    Benchmark instrumentation only: wraps, on the instance, the two calls a
    node's step makes on its :class:`~trainer.node.NodeGroup`: the gradient
    reduce-scatter (``reduce_grads``) and the parameter all-gather
    (``gather_params``). Both include waiting for the node's other local
    processes to reach the same collective.
    """
    totals["node_coll_s"] = 0.0
    for name in ("reduce_grads", "gather_params"):
        call = getattr(group, name)

        def timed(*args, _call=call, **kwargs):
            t0 = time.perf_counter()
            try:
                return _call(*args, **kwargs)
            finally:
                totals["node_coll_s"] += time.perf_counter() - t0

        setattr(group, name, timed)


def run_trainer(spec: Spec) -> dict:
    """One trainer process: the shared loop with ``tr.step()`` as the update; bytes and phases counted.

    A plain trainer, or one local process of a trainer node when
    ``LOCAL_WORLD_SIZE`` > 1 (the Trainer reads the node variables itself).
    """
    from trainer import Trainer
    from trainer.steppers.node import NodeStepper
    from transpiler import RoleEnv

    env = RoleEnv.from_env()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    rank = env.trainer_id * local_size + local_rank
    tr = Trainer(transpile(spec, env).get_trainer_program())
    try:
        phases = PhaseTimer(tr.channels, tr.program.pservers)
        node_times: Dict[str, float] = {}
        node = tr.stepper if isinstance(tr.stepper, NodeStepper) else None
        if node is not None:
            time_node_collectives(node.group, node_times)
        # The pservers this process pushes to and pulls from each step (a node's local
        # rank: only its share of them); their calls run in parallel.
        calls = len(node.group.endpoints) if node is not None else len(env.pservers)

        def counters() -> Dict[str, float]:
            return {
                "bytes_pushed": tr.channels.bytes_pushed,
                "bytes_pulled": tr.channels.bytes_pulled,
                **phases.snapshot(),
                **node_times,
            }

        result = timed_loop(tr.model, make_batches(spec, rank), tr.step, spec.warmup, counters)
    finally:
        tr.close()
    return {
        "rank": rank,
        "node": env.trainer_id,
        "local_rank": local_rank,
        "local_world_size": local_size,
        "pservers": len(env.pservers),
        "pserver_calls": calls,
        **result,
    }


ROLES = {"ddp": run_ddp, "pserver": run_pserver, "trainer": run_trainer}


def write_result(path: str, result: dict) -> None:
    """Write a role's result JSON atomically (the benchmark reads it once the role has exited)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("role", choices=sorted(ROLES))
    p.add_argument("--spec", required=True, help="JSON of a Spec")
    p.add_argument("--out", required=True, help="where to write the result JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.role != "pserver":
        torch.set_num_threads(1)  # pservers take theirs from the config (1)
    write_result(args.out, ROLES[args.role](Spec.from_json(args.spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
