"""DistributeTranspilerConfig: every knob of a distributed job, in one place (its checks: :mod:`.checks`).

The config travels inside the plans, so a pserver and its trainers agree on
deadlines and chunk sizes without further flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from .checks import MIN_BLOCK_SIZE_FLOOR, MODE_ALIASES, validate


@dataclass
class DistributeTranspilerConfig:
    """How the transpiler slices and places parameters, and how roles talk.

    Fields (the type and the default are the dataclass's own; this list gives each its meaning, and
    ``python -m transpiler config-reference`` renders both as docs/configuration.md, so every field must
    have an entry):

    - ``slice_var_up``: cut big parameters into row blocks spread over pservers; False keeps one block per
      parameter.
    - ``split_method``: block placement: "RoundRobin" deals blocks to pservers in order; "HashName" uses a
      stable hash (BLAKE2b) of the block name.
    - ``min_block_size``: a parameter of ``numel`` elements gets ``min(#pservers, max(1, numel //
      min_block_size))`` blocks of whole rows (never more blocks than rows); values below 8192 are refused
      (tiny blocks cost more in per-message overhead than they gain in balance).
    - ``max_staleness``: async mode only; a trainer that is this many steps ahead of the slowest live
      trainer waits. None: unbounded.
    - ``k_steps``: GEO mode (Paddle's ``a_sync_configs["k_steps"]``; needs ``sync_mode=False``): each
      trainer runs the optimizer on its own copy and every ``k_steps`` steps pushes the change since its
      last sync (dense blocks whole, tables the rows it touched; tables train with sgd); each pserver adds
      it divided by the number of trainers and the trainer pulls the sum (docs/modes.md#geo). 0: off (async
      pushes every step's gradients).
    - ``backup_trainers``: sync mode; b > 0: step s applies with the mean of the first ``trainers - b``
      trainers to claim it (TensorFlow's ``SyncReplicasOptimizer`` with ``replicas_to_aggregate``); the
      first pserver decides for all. A later trainer is told it was dropped: its gradients of s are left
      out, it goes on from the applied step without a roll-back (docs/modes.md#backup-trainers). 0: every
      live trainer's push.
    - ``connect_timeout``: seconds a trainer waits for each pserver to come up before failing with an error
      that names it; also how long a finished trainer keeps sending its Close to a pserver that died under
      it (a restarted pserver would otherwise wait for that trainer).
    - ``barrier_timeout``: seconds a sync step waits for the other trainers' gradients before failing with
      the missing trainer ids; in collective mode, the timeout of the rendezvous and of every collective.
    - ``rpc_timeout``: seconds; the deadline of one push or pull transfer.
    - ``chunk_bytes``: largest tensor piece per gRPC message (4 KiB to 64 MiB).
    - ``push_lanes``: connections per pserver (1-16) a streamed push-pull (over 4 MiB; not through shared
      memory) of at least ``push_lanes`` chunks is split across, blocks dealt by bytes
      (``proto/lane_blocks.py``); same semantics. 1: one connection (docs/performance.md#across-hosts).
    - ``pserver_torch_threads``: torch intra-op threads in a pserver; its updates are memory-bound, and
      extra threads steal cores from trainers.
    - ``pserver_rpc_workers``: gRPC handler threads per pserver; 0 picks ``max(4, cores)``. Not per
      trainer: a waiting call (sync barrier, min_step, staleness, Reduce) parks, holding no thread.
    - ``pserver_stretches_on_loop``: in sync training a parked call's CPU stretches run on the event loop
      where nothing in them can block, else in the handler pool (docs/performance.md); False: always in the
      pool.
    - ``async_pipeline``: async mode only; ``Trainer.step()`` sends the step's gradients in the background
      and returns at once, and the parameters that push brings back are installed at the next ``step()``:
      the next forward/backward overlaps the transfer and the pservers' update, at the price of one more
      step of staleness (Paddle's async communicator does the same). Off by default: momentum SGD with
      small batches (``train_mlp.py``) can diverge under the extra staleness; Adam/Adagrad models such as
      the CTR example train as well with it (and turn it on).
    - ``read_ahead``: ``Trainer.batches()`` reads the next item from the loader on a background thread
      while the current one trains, and, given ``prefetch=``, deduplicates and routes its table ids there
      (with ``async_pipeline``, also fetches its rows), so the step that sends them ahead does no such work
      itself. The same batches and ids as without it, so sync training stays exact; off reads each item in
      turn. The loader is then advanced from that thread (one item at a time).
    - ``checkpoint_dir``: where pservers write checkpoints (blocks, table shards, optimizer state,
      trainers' data positions), one directory per step; a pserver started with a checkpoint there resumes
      from the latest complete one. Must be storage every pserver sees (docs/recovery.md#checkpoints).
    - ``checkpoint_every``: a checkpoint every this many steps (sync; in async, updates of each pserver);
      0: only on SIGTERM, when all trainers have closed, and when asked (``PserverTrainer.checkpoint()``).
    - ``checkpoint_keep``: complete checkpoints kept per pserver; older ones are deleted.
    - ``export_dir``: where pservers export the distributed tables for serving
      (docs/tables.md#exports-for-serving): a base, then deltas (rows changed since the previous export,
      tombstones of evicted ids), each completed by a ``DONE`` file. Storage every pserver sees.
    - ``export_every``: an export every this many steps (sync; in async, updates of each pserver); 0: no
      exports.
    - ``export_every_seconds``: sync mode; instead of ``export_every``, an export about every this many
      seconds (pserver 0's clock picks a step two steps ahead and writes it to ``export_dir/NEXT``; the
      others follow it); 0: off.
    - ``export_base_every``: every this-many-th export is a base (the first always is); the others are
      deltas.
    - ``export_keep_bases``: complete bases kept (with the deltas after them); older exports are deleted.
    - ``table_disk_dir``: local directory of the tables' disk tiers (tables with ``ram_rows``): a working
      area each pserver empties when it starts and removes when it stops (checkpoints hold the rows). None:
      the system's temp directory.
    - ``heartbeat_interval``: seconds; a trainer heartbeats only the pservers it has been silent towards
      for an interval (no push, pull, lookup or other call that reached them: a data stall, a long
      evaluation, a wait in a sync barrier), one heartbeat per pserver per interval at most, none while one
      is in flight (deadline ``heartbeat_timeout``); in steady training none: its calls are its signs of
      life. A trainer id heard from within three intervals (:attr:`session_alive_window`) is alive: a
      second process saying Hello for it is refused; a process restarted after the old one went quiet that
      long takes the id over.
    - ``heartbeat_timeout``: seconds; a trainer silent this long (no call of any kind, heartbeats included)
      is dropped from the barrier (sync) and the staleness bound (async), with a log line naming it; it
      rejoins by starting again.
    - ``recovery_timeout``: seconds a trainer keeps retrying an unavailable or restarted pserver (with
      backoff) before failing.
    - ``trainer_rejoin_timeout``: seconds; a dropped trainer that has not rejoined this long after its drop
      is counted as closed, with a log line naming it, so the pservers exit once the others have closed
      instead of serving forever. It may still rejoin later (as a closed trainer can).
    - ``nonfinite_grads``: a pushed gradient holding NaN or Inf is refused with INVALID_ARGUMENT ("refuse")
      or applied as is ("apply").
    - ``push_during_backward``: a step's push to each pserver starts streaming while backward still runs,
      each block as soon as its gradient is final (same result as pushing after backward). Needs one
      backward pass per step (a second one raises, naming this switch); trainer nodes, the async pipeline
      and CUDA models push after backward. Off by default: where the transfer costs CPU rather than wire
      time (gRPC Python, few cores) it competes with backward and measured slower (job D on 2 cores: 0.72x
      DDP against 0.83x pushing after backward).
    - ``grad_wire_dtype``: "bfloat16" or "float16": gradients travel in this dtype, half the bytes of
      float32 (docs/gpu.md#mixed-precision). In pserver mode trainers push float32/float64 gradients (dense
      blocks and table rows) cast to it and the pservers widen them on arrival, so parameters, optimizer
      state and pulls stay in the model's dtype and each gradient is rounded once, before the trainers'
      mean. In collective mode DDP all-reduces in it (torch's ``bf16_compress_hook`` /
      ``fp16_compress_hook``; not with Local SGD). bfloat16 keeps 8 significant bits and float32's range;
      float16 keeps 11 bits, but a gradient beyond 65504 becomes Inf (a pserver then refuses the push under
      ``nonfinite_grads="refuse"``). None: as computed.
    - ``mode``: "pserver" trains through pservers; "collective" (Paddle's "nccl2", accepted and stored as
      "collective") trains with no pservers: every process wraps the model in ``DistributedDataParallel``
      and steps the program's optimizer itself (docs/gpu.md#collective-mode-nccl2-ddp-no-pservers).
      Collective mode is synchronous and refuses distributed tables; ``barrier_timeout`` bounds its
      collectives.
    - ``bucket_cap_mb``: collective mode; size of DDP's fused all-reduce buckets in MiB (Paddle's
      ``fuse_all_reduce`` / ``FLAGS_fuse_parameter_memory_size``): bigger buckets mean fewer, larger
      collectives but later overlap with the backward pass.
    - ``use_local_sgd``: collective mode; Local SGD (torch's ``post_localSGD_hook`` +
      ``PostLocalSGDOptimizer``): after the warm-up, gradients are all-reduced only among a node's
      processes and parameters are averaged over all processes every ``local_sgd_steps`` steps. Refused in
      pserver mode.
    - ``local_sgd_steps``: Local SGD's averaging period in steps; 1 averages every step (plain synchronous
      SGD for sgd/momentum, slower than plain all-reduce).
    - ``local_sgd_warmup_steps``: steps of plain global gradient all-reduce before Local SGD starts.
    - ``metrics_port``: the port on which each pserver serves Prometheus metrics over HTTP (``/metrics``),
      bound on the pserver's own host (the host of its endpoint); 0 picks a free port (logged). None: the
      ``PS_METRICS_PORT`` environment variable, if set, else no metrics server. A value here (or
      ``ps-server --metrics_port``) wins over the variable.
    - ``health_port``: the port of a second gRPC server on each pserver that serves only ``grpc.health.v1``
      (SERVING once the pserver is ready, NOT_SERVING while it shuts down), in plaintext and without the
      auth token, for Kubernetes' gRPC probes, which can send neither; the training service stays on the
      main port behind its token. 0 picks a free port. None: ``PS_HEALTH_PORT`` if set, else no health port
      (the main port still serves health, behind the token).
    - ``shared_memory``: a trainer whose pserver runs on its own host (the same user and PID namespace)
      writes each push into shared memory and the pserver its answer (``proto/shared_memory.py``); the gRPC
      call carries only where they are (docs/architecture.md#same-host). A pserver elsewhere refuses the
      first such push before reading it, and from then on that trainer sends it bytes through gRPC. Same
      semantics either way; False always sends bytes through gRPC.
    - ``data_channel``: pushes, pulls and prefetches travel over each pserver's data port, outside gRPC
      (docs/dataplane.md): a TCP connection per trainer and lane, with the same token, TLS and sessions,
      and the bytes in shared memory when ``shared_memory`` allows. gRPC keeps the control. False: they
      travel over gRPC. Same semantics either way.
    - ``data_reactors``: threads serving a pserver's data connections (1-64); not per trainer: a waiting
      call parks, holding no thread.
    - ``retain_freed_memory``: a trainer process asks glibc's malloc to keep the buffers it frees (up to
      256 MiB each, up to 1 GiB of free heap) for its next step instead of returning them to the kernel
      (``trainer/memory.py``): every step frees and re-allocates its gradients and activations, and fresh
      pages cost a page fault and zeroing each (job D: 11-27 ms of system time per step, ~10% of
      forward/backward). The process's resident memory then stays at its peak. False: malloc's defaults. No
      effect where the C library is not glibc.
    - ``server_replicas``: 2 gives every pserver shard a hot standby (docs/recovery.md#hot-standby): the
      process at ``replica_endpoints[k]`` holds the same state as shard k's primary, which acknowledges a
      push only once the backup has it; who leads is decided through ``coordinator``. 1: no replicas. None:
      the ``PS_SERVER_REPLICAS`` environment variable (ps-launch sets it), else 1.
    - ``replica_endpoints``: with two replicas, the second process of each shard, comma-separated in the
      order of the pservers (shard k's pair is ``pservers[k]`` and ``replica_endpoints[k]``; either may
      lead). None: ``PS_REPLICA_ENDPOINTS`` (or derived on Kubernetes and Slurm).
    - ``coordinator``: the etcd cluster that decides each shard's primary, as ``http://host:port`` URLs,
      comma-separated. None: ``PS_COORDINATOR``.
    - ``coordinator_prefix``: the etcd key prefix of this job; two jobs with the same plan on one etcd need
      their own prefixes. None: ``PS_COORDINATOR_PREFIX`` (ps-launch sets one per launch), else
      ``/torch-pserver/<layout digest>``.
    - ``replica_lease_ttl``: the primary's lease in etcd, in whole seconds. A primary that dies is replaced
      about this long after its last renewal; one that cannot renew it for three quarters of it (cut off,
      or its process starved of CPU) is fenced, so a host that runs far more busy processes than cores
      wants 2-3 (etcd rounds a TTL below 1.5 of its election timeout up: start etcd with
      ``--election-timeout 500 --heartbeat-interval 50`` for 1 s). None: ``PS_REPLICA_LEASE_TTL``, else 1.
    - ``replica_takeover_timeout``: seconds a pserver process that is not among its shard's in-sync
      replicas (a restart after both were lost) waits for one to lead, then leads from its checkpoint:
      trainers roll back to it as without replicas.
    - ``replica_digest_every``: every this many updates the primary sends a digest of its state (blocks,
      optimizer state, table rows, roster) with the update and the backup compares it with its own, logging
      a mismatch; 0: off.
    - ``tensorboard_dir``: the job's TensorBoard log directory; each trainer process that writes uses its
      own subdirectory, ``trainer-<id>`` (local rank R > 0 of a node: ``trainer-<id>.<R>``)
      (docs/tensorboard.md). Needs the ``tensorboard`` package (the ``tensorboard`` extra); without it
      nothing is written and one log line says so. None: ``PS_TENSORBOARD_DIR`` (``ps-launch
      --tensorboard_dir`` sets it for every role), else off.
    - ``tensorboard_trainers``: who writes: "first", trainer 0's first process (rank 0 in collective mode);
      "all", every trainer process. Only trainer 0's first process asks the pservers for their Stats. None:
      ``PS_TENSORBOARD_TRAINERS``, else "first".
    - ``tensorboard_every``: the periodic scalars (rates, step time split, pserver Stats) are written every
      this many steps, as means over them; one Stats call per pserver per this many steps at most, on a
      background thread with a deadline each. None: ``PS_TENSORBOARD_EVERY``, else 20.
    """

    slice_var_up: bool = True
    split_method: str = "RoundRobin"
    min_block_size: int = MIN_BLOCK_SIZE_FLOOR
    max_staleness: Optional[int] = None
    k_steps: int = 0
    backup_trainers: int = 0
    connect_timeout: float = 120.0
    barrier_timeout: float = 300.0
    rpc_timeout: float = 300.0
    chunk_bytes: int = 1 << 20
    push_lanes: int = 1
    pserver_torch_threads: int = 1
    pserver_rpc_workers: int = 0
    pserver_stretches_on_loop: bool = True
    async_pipeline: bool = False
    read_ahead: bool = True
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 3
    export_dir: Optional[str] = None
    export_every: int = 0
    export_every_seconds: float = 0.0
    export_base_every: int = 10
    export_keep_bases: int = 2
    table_disk_dir: Optional[str] = None
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 30.0
    recovery_timeout: float = 300.0
    trainer_rejoin_timeout: float = 600.0
    nonfinite_grads: str = "refuse"
    push_during_backward: bool = False
    grad_wire_dtype: Optional[str] = None
    mode: str = "pserver"
    bucket_cap_mb: float = 25.0
    use_local_sgd: bool = False
    local_sgd_steps: int = 1
    local_sgd_warmup_steps: int = 0
    metrics_port: Optional[int] = None
    health_port: Optional[int] = None
    shared_memory: bool = True
    data_channel: bool = True
    data_reactors: int = 2
    retain_freed_memory: bool = True
    server_replicas: Optional[int] = None
    replica_endpoints: Optional[str] = None
    coordinator: Optional[str] = None
    coordinator_prefix: Optional[str] = None
    replica_lease_ttl: Optional[int] = None
    replica_takeover_timeout: float = 30.0
    replica_digest_every: int = 500
    tensorboard_dir: Optional[str] = None
    tensorboard_trainers: Optional[str] = None
    tensorboard_every: Optional[int] = None

    @property
    def session_alive_window(self) -> float:
        """Seconds a trainer's session stays alive after its last call: three heartbeat intervals."""
        return 3 * self.heartbeat_interval

    @property
    def collective(self) -> bool:
        """True in collective ("nccl2") mode: DDP among the trainers, no pservers."""
        return MODE_ALIASES.get(self.mode, self.mode) == "collective"

    def __post_init__(self) -> None:
        if isinstance(self.mode, str):
            self.mode = MODE_ALIASES.get(self.mode, self.mode)
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first field that is out of range (or two fields that clash)."""
        validate(self)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "DistributeTranspilerConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown DistributeTranspilerConfig fields: {sorted(unknown)}")
        return cls(**data)
