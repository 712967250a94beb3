"""The emulated fan-in's job: job S's program transpiled for K trainers, and every trainer's gradients.

Shared by ``benchmarks.bench_fanin`` (which checks the applied model), its pservers and its load generators
(``benchmarks.jobs.fanin_workers``). The program is job S's
(:func:`benchmarks.jobs.job_s_program.build_program`: one shared dim-16 distributed table over 26 slots,
MLP 429-256-128-1, plain SGD lr 0.05 for both) with job S's shape given here, so the peers' ``jobs.py`` is
not needed (CI has none).

A trainer's gradients are a pure function of (seed, trainer, step), so whoever checks the model can compute
what was pushed without being told:

- ids: job S's batch draw, ``slot << 40 | z`` with z ~ Zipf(1.2) - 1 mod 1,000,000 over 26 slots and
  ``batch`` rows (:func:`batch_ids`, sorted unique, as a trainer dedupes them);
- the rows of those ids: one 64-bit hash of (seed, trainer, step, id) cut into 16 four-bit columns, each an
  integer in [-8, 7] times 2^-6 (:func:`sparse_rows`);
- each dense block: integers in [-8, 7] times 2^-6 from a generator seeded by (seed, trainer, step)
  (:func:`dense_gradients`).

On that grid every sum of up to 2^17 gradients is exact in float32 and so is its mean over a power-of-two
K: the sync model after the run differs from ``initial - lr * sum over steps of the mean`` only by the
rounding of ``lr * mean`` and of the subtraction, once per step (see :data:`TOLERANCE`).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Sequence

import numpy as np
import torch

from benchmarks.jobs.job_s_program import build_program
from transpiler import DistributeTranspiler, DistributeTranspilerConfig

# Job S's shape (shared/peers/jobs.py: S_SLOTS, S_DENSE, S_EMB_DIM, S_HIDDEN, S_LR), read by
# job_s_program.CtrNet.
JOB_S = SimpleNamespace(S_SLOTS=26, S_DENSE=13, S_EMB_DIM=16, S_HIDDEN=(256, 128), S_LR=0.05)
VOCAB = 1_000_000
ZIPF_A = 1.2
SLOT_SHIFT = 40
GRID = 2.0**-6
# Largest |applied - expected| accepted by the sync check: float32's spacing near the largest parameter
# (|w| < 0.07 for the MLP's default init; spacing 7.5e-9) times a margin for the two roundings per step.
TOLERANCE = 1e-6

_M64 = np.uint64(0xFFFFFFFFFFFFFFFF)


@dataclass
class Spec:
    """One fan-in run: ``trainers`` (K) emulated trainers against ``pservers``, in ``sync_mode``, for
    ``steps`` steps.

    ``batch``: rows of a job S batch (its ids per step); ``seed``: of the gradients and ids;
    ``heartbeat_interval``: the trainers', ``heartbeat_timeout``: the pservers'
    (DistributeTranspilerConfig; 0: the library's default); ``rpc_workers``: the pservers'
    ``pserver_rpc_workers`` (0: the library's default, left out of the config); ``timeout``: seconds every
    wait of a run may take at most; ``run_dir``: where the processes of a run meet (files ``hello``,
    ``go``, ``finish``, ``hello-G``, ``stepped-G``, ``result-G.pt``); ``check_ids``: how many ids' rows the
    sync check reads; ``in_flight`` (async only; 0: no bound): how many of a load generator's trainers are
    inside a step at once (:func:`benchmarks.jobs.fanin_workers.stepping`). ``checkpoint_dir`` and
    ``checkpoint_every`` (a run that kills a pserver): where and how often the pservers checkpoint, so that
    the one restarted resumes and the trainers re-sync with it (``recovery_timeout``, 0: the library's).
    ``replica_endpoints`` (hot standby, with ``coordinator``, etcd's URL): shard k's second process serves at
    ``replica_endpoints[k]``.
    """

    trainers: int
    pservers: List[str]
    sync_mode: bool = True
    steps: int = 5
    batch: int = 512
    seed: int = 0
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 0.0
    rpc_workers: int = 0
    timeout: float = 600.0
    run_dir: str = ""
    check_ids: int = 256
    in_flight: int = 0
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    recovery_timeout: float = 0.0
    replica_endpoints: List[str] = dataclasses.field(default_factory=list)
    coordinator: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Spec":
        return cls(**json.loads(text))


def transpiler(spec: Spec, trainer_id: int = 0) -> DistributeTranspiler:
    """Job S's program transpiled for ``spec.trainers`` trainers (gradients through gRPC, no shared memory).

    ``shared_memory`` is off: emulated trainers on the pserver's host would otherwise hand it their
    bytes in shared memory, and the fan-in measures the wire between hosts.
    """
    options = {"shared_memory": False, "heartbeat_interval": spec.heartbeat_interval}
    if spec.rpc_workers:
        options["pserver_rpc_workers"] = spec.rpc_workers
    if spec.heartbeat_timeout:
        options["heartbeat_timeout"] = spec.heartbeat_timeout
    if spec.checkpoint_dir:
        options.update(checkpoint_dir=spec.checkpoint_dir, checkpoint_every=spec.checkpoint_every)
    if spec.recovery_timeout:
        options["recovery_timeout"] = spec.recovery_timeout
    if spec.replica_endpoints:
        options.update(
            server_replicas=2,
            replica_endpoints=",".join(spec.replica_endpoints),
            coordinator=spec.coordinator,
        )
    t = DistributeTranspiler(DistributeTranspilerConfig(**options))
    t.transpile(
        trainer_id,
        program=build_program(JOB_S),
        pservers=",".join(spec.pservers),
        trainers=spec.trainers,
        sync_mode=spec.sync_mode,
    )
    return t


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wrapping arithmetic)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _key(seed: int, trainer: int, step: int) -> int:
    """One 63-bit number for (seed, trainer, step)."""
    x = np.array([(seed * 1_000_003 + trainer) * 1_000_033 + step], dtype=np.uint64) & _M64
    return int(_mix(x)[0] >> np.uint64(1))


def batch_ids(spec: Spec, trainer: int, step: int) -> np.ndarray:
    """Trainer ``trainer``'s ids at ``step``, as job S draws a batch: sorted unique int64."""
    rng = np.random.default_rng(_key(spec.seed, trainer, step))
    z = (rng.zipf(ZIPF_A, size=(spec.batch, JOB_S.S_SLOTS)) - 1) % VOCAB
    slots = np.arange(JOB_S.S_SLOTS, dtype=np.int64) << SLOT_SHIFT
    return np.unique(slots | z.astype(np.int64))


def sparse_rows(spec: Spec, trainer: int, step: int, ids: np.ndarray) -> torch.Tensor:
    """The gradient rows trainer ``trainer`` pushes at ``step`` for ``ids``: float32, one row per id."""
    with np.errstate(over="ignore"):
        h = _mix(ids.astype(np.uint64) ^ np.uint64(_key(spec.seed, trainer, step)))
    shifts = np.arange(JOB_S.S_EMB_DIM, dtype=np.uint64) * np.uint64(4)
    nibbles = ((h[:, None] >> shifts[None, :]) & np.uint64(15)).astype(np.float32)
    return torch.from_numpy((nibbles - 8.0) * np.float32(GRID))


def dense_gradients(spec: Spec, blocks: Sequence, trainer: int, step: int) -> Dict[str, torch.Tensor]:
    """Trainer ``trainer``'s gradient of every block of ``blocks`` (the plan's BlockSpecs) at ``step``."""
    g = torch.Generator().manual_seed(_key(spec.seed, trainer, step))
    return {
        b.name: torch.randint(-8, 8, tuple(b.shape), generator=g, dtype=torch.float32).mul_(GRID)
        for b in blocks
    }


def check_ids(spec: Spec) -> np.ndarray:
    """Ids whose rows the sync check reads: each slot's most frequent id, trainer 0's first ids, one never
    drawn."""
    heads = np.arange(JOB_S.S_SLOTS, dtype=np.int64) << SLOT_SHIFT
    first = batch_ids(spec, 0, 0)
    drawn = first[np.linspace(0, first.size - 1, max(1, spec.check_ids - heads.size - 1)).astype(np.int64)]
    never = np.array([(JOB_S.S_SLOTS + 1) << SLOT_SHIFT], dtype=np.int64)  # no slot 27: never pushed
    return np.unique(np.concatenate([heads, drawn, never]))


def expected_model(
    spec: Spec,
    blocks: Sequence,
    initial: Dict[str, torch.Tensor],
    ids: np.ndarray,
    initial_rows: torch.Tensor,
) -> tuple:
    """(blocks, rows of ``ids``) after ``spec.steps`` sync steps of plain SGD, in float64.

    ``initial - lr * sum over steps of (sum over trainers of the pushed gradient) / K``: every
    trainer's gradients are computed again here from (seed, trainer, step), not read from the run.
    """
    k, lr = spec.trainers, JOB_S.S_LR
    dense = {name: torch.zeros(t.shape, dtype=torch.float64) for name, t in initial.items()}
    rows = torch.zeros(tuple(initial_rows.shape), dtype=torch.float64)
    for step in range(spec.steps):
        for trainer in range(k):
            for name, g in dense_gradients(spec, blocks, trainer, step).items():
                dense[name] += g.double()
            hit = np.isin(ids, batch_ids(spec, trainer, step), assume_unique=True)
            if hit.any():
                rows[torch.from_numpy(hit)] += sparse_rows(spec, trainer, step, ids[hit]).double()
    want = {name: initial[name].double() - lr * total / k for name, total in dense.items()}
    return want, initial_rows.double() - lr * rows / k
