"""The checks of a :class:`~transpiler.config.fields.DistributeTranspilerConfig`: each field's range, and
clashes.

Functions of the config, so that the dataclass's module stays the one place that lists the fields and says
what each means.
"""

from __future__ import annotations

from psproto.lane_blocks import MAX_LANES

# The values some fields take (the dataclass's module imports them from here).
SPLIT_METHODS = ("RoundRobin", "HashName")
MODES = ("pserver", "collective")
# Paddle calls collective training "nccl2" mode; both names mean the same here.
MODE_ALIASES = {"nccl2": "collective"}
MIN_BLOCK_SIZE_FLOOR = 8192
NONFINITE_GRADS = ("refuse", "apply")
GRAD_WIRE_DTYPES = (None, "bfloat16", "float16")
TENSORBOARD_TRAINERS = ("first", "all")


def validate(config) -> None:
    """Raise ValueError naming the first field of ``config`` that is out of range (or two that clash)."""
    if config.split_method not in SPLIT_METHODS:
        raise ValueError(f"split_method must be one of {SPLIT_METHODS}, got {config.split_method!r}")
    if not isinstance(config.min_block_size, int) or config.min_block_size < MIN_BLOCK_SIZE_FLOOR:
        raise ValueError(
            f"min_block_size={config.min_block_size!r} is refused: it must be an int of at "
            f"least {MIN_BLOCK_SIZE_FLOOR} elements, because smaller blocks cost more in "
            f"per-message and per-update overhead than they gain in load balance"
        )
    if config.max_staleness is not None and (
        not isinstance(config.max_staleness, int) or config.max_staleness < 0
    ):
        raise ValueError(f"max_staleness must be None or an int >= 0, got {config.max_staleness!r}")
    for name in (
        "connect_timeout",
        "barrier_timeout",
        "rpc_timeout",
        "heartbeat_interval",
        "heartbeat_timeout",
        "recovery_timeout",
        "trainer_rejoin_timeout",
    ):
        value = getattr(config, name)
        if not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    if not isinstance(config.chunk_bytes, int) or not (4096 <= config.chunk_bytes <= (64 << 20)):
        raise ValueError(f"chunk_bytes must be an int in [4096, 64 MiB], got {config.chunk_bytes!r}")
    if (
        isinstance(config.data_reactors, bool)
        or not isinstance(config.data_reactors, int)
        or not (1 <= config.data_reactors <= 64)
    ):
        raise ValueError(f"data_reactors must be an int in [1, 64], got {config.data_reactors!r}")
    if not isinstance(config.pserver_torch_threads, int) or config.pserver_torch_threads < 1:
        raise ValueError(f"pserver_torch_threads must be an int >= 1, got {config.pserver_torch_threads!r}")
    for name in (
        "async_pipeline",
        "read_ahead",
        "shared_memory",
        "data_channel",
        "retain_freed_memory",
        "pserver_stretches_on_loop",
        "use_local_sgd",
        "push_during_backward",
    ):
        if not isinstance(getattr(config, name), bool):
            raise ValueError(f"{name} must be a bool, got {getattr(config, name)!r}")
    if config.heartbeat_timeout <= config.heartbeat_interval:
        raise ValueError(
            f"heartbeat_timeout ({config.heartbeat_timeout}) must exceed "
            f"heartbeat_interval ({config.heartbeat_interval})"
        )
    if config.checkpoint_dir is not None and (
        not isinstance(config.checkpoint_dir, str) or not config.checkpoint_dir
    ):
        raise ValueError(f"checkpoint_dir must be None or a non-empty path, got {config.checkpoint_dir!r}")
    if not isinstance(config.checkpoint_every, int) or config.checkpoint_every < 0:
        raise ValueError(f"checkpoint_every must be an int >= 0, got {config.checkpoint_every!r}")
    if not isinstance(config.checkpoint_keep, int) or config.checkpoint_keep < 1:
        raise ValueError(f"checkpoint_keep must be an int >= 1, got {config.checkpoint_keep!r}")
    if config.export_dir is not None and (not isinstance(config.export_dir, str) or not config.export_dir):
        raise ValueError(f"export_dir must be None or a non-empty path, got {config.export_dir!r}")
    for name, low in (
        ("export_every", 0),
        ("export_base_every", 1),
        ("export_keep_bases", 1),
        ("pserver_rpc_workers", 0),
        ("push_lanes", 1),
        ("local_sgd_steps", 1),
        ("local_sgd_warmup_steps", 0),
        ("k_steps", 0),
        ("backup_trainers", 0),
    ):
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if config.table_disk_dir is not None and (
        not isinstance(config.table_disk_dir, str) or not config.table_disk_dir
    ):
        raise ValueError(f"table_disk_dir must be None or a non-empty path, got {config.table_disk_dir!r}")
    seconds = config.export_every_seconds
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 <= seconds < float("inf"):
        raise ValueError(f"export_every_seconds must be a number of seconds >= 0, got {seconds!r}")
    if config.export_every and seconds:
        raise ValueError("export_every and export_every_seconds are both set; choose one schedule")
    if (config.export_every or seconds) and config.export_dir is None:
        raise ValueError("export_every / export_every_seconds need an export_dir to write to")
    if config.nonfinite_grads not in NONFINITE_GRADS:
        raise ValueError(f"nonfinite_grads must be one of {NONFINITE_GRADS}, got {config.nonfinite_grads!r}")
    if config.grad_wire_dtype not in GRAD_WIRE_DTYPES:
        raise ValueError(f"grad_wire_dtype must be one of {GRAD_WIRE_DTYPES}, got {config.grad_wire_dtype!r}")
    if config.push_lanes > MAX_LANES:
        raise ValueError(f"push_lanes must be at most {MAX_LANES}, got {config.push_lanes!r}")
    for name in ("metrics_port", "health_port"):
        port = getattr(config, name)
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536
        ):
            raise ValueError(f"{name} must be None or a port number in [0, 65535], got {port!r}")
    if config.metrics_port == config.health_port and config.metrics_port:
        raise ValueError(
            f"metrics_port and health_port are both {config.metrics_port}; give each its own port"
        )
    _collective(config)
    _replicas(config)
    _tensorboard(config)
    _geo(config)


def _geo(config) -> None:
    """GEO mode's field against the switches that only mean something when every step pushes gradients."""
    if config.backup_trainers and (config.k_steps or config.collective or config.push_during_backward):
        raise ValueError(
            f"backup_trainers={config.backup_trainers} is for sync pserver training, pushing after backward "
            f"(a step claims its place first); it does not combine with k_steps, mode='collective' or "
            f"push_during_backward"
        )
    if config.k_steps:
        clash = [
            n
            for n in ("max_staleness", "async_pipeline", "push_during_backward", "use_local_sgd")
            if getattr(config, n) not in (None, False)
        ] + (["mode='collective'"] if config.collective else [])
        if clash:
            raise ValueError(
                f"k_steps={config.k_steps} (GEO mode: trainers train locally and push deltas every "
                f"k_steps) does not combine with {', '.join(clash)}, which concern pushing "
                f"every step's gradients; unset them or set k_steps=0"
            )


def _tensorboard(config) -> None:
    """The TensorBoard fields; the trainer reads their variables (trainer/board/settings.py)."""
    if config.tensorboard_dir is not None and (
        not isinstance(config.tensorboard_dir, str) or not config.tensorboard_dir
    ):
        raise ValueError(f"tensorboard_dir must be None or a non-empty path, got {config.tensorboard_dir!r}")
    if config.tensorboard_trainers not in (None, *TENSORBOARD_TRAINERS):
        raise ValueError(
            f"tensorboard_trainers must be None or one of {TENSORBOARD_TRAINERS}, "
            f"got {config.tensorboard_trainers!r}"
        )
    every = config.tensorboard_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise ValueError(f"tensorboard_every must be None or an int >= 1, got {every!r}")


def _replicas(config) -> None:
    """The hot-standby fields (docs/recovery.md, "Hot standby"); their environment fallbacks are read at
    transpile."""
    if config.server_replicas is not None and (
        isinstance(config.server_replicas, bool) or config.server_replicas not in (1, 2)
    ):
        raise ValueError(
            f"server_replicas must be 1 (no replicas) or 2 (a backup per pserver shard), "
            f"got {config.server_replicas!r}"
        )
    for name in ("replica_endpoints", "coordinator", "coordinator_prefix"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ValueError(f"{name} must be None or a non-empty string, got {value!r}")
    ttl = config.replica_lease_ttl
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise ValueError(
            f"replica_lease_ttl must be a whole number of seconds >= 1 (etcd's unit), got {ttl!r}"
        )
    timeout = config.replica_takeover_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
        raise ValueError(f"replica_takeover_timeout must be a positive number of seconds, got {timeout!r}")
    every = config.replica_digest_every
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise ValueError(f"replica_digest_every must be an int >= 0, got {every!r}")
    if config.server_replicas == 2 and config.collective:
        raise ValueError("server_replicas=2 replicates pservers; collective mode has none")


def _collective(config) -> None:
    """The collective-mode fields: mode, bucket size, Local SGD."""
    if not isinstance(config.mode, str) or MODE_ALIASES.get(config.mode, config.mode) not in MODES:
        raise ValueError(
            f"mode must be one of {MODES} (or {sorted(MODE_ALIASES)} for "
            f"{sorted(set(MODE_ALIASES.values()))}), got {config.mode!r}"
        )
    if (
        isinstance(config.bucket_cap_mb, bool)
        or not isinstance(config.bucket_cap_mb, (int, float))
        or not 0 < config.bucket_cap_mb < float("inf")
    ):
        raise ValueError(f"bucket_cap_mb must be a positive number of MiB, got {config.bucket_cap_mb!r}")
    if config.use_local_sgd and config.grad_wire_dtype is not None:
        raise ValueError("grad_wire_dtype and use_local_sgd both set DDP's communication hook; choose one")
    if config.use_local_sgd and not config.collective:
        raise ValueError(
            "use_local_sgd needs mode='collective' (or 'nccl2'): in pserver mode the "
            "pservers hold the parameters and there is nothing to average locally"
        )
