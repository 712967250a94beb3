"""Which device a trainer process computes on, and the process group its node's processes share."""

from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

from .rendezvous import SharedStore

log = logging.getLogger(__name__)


def pick_device(local_rank: int) -> torch.device:
    """``cuda:local_rank`` when CUDA is there (``CUDA_VISIBLE_DEVICES`` renumbers the GPUs), else CPU.

    Raises ValueError when there are CUDA devices but fewer than local ranks
    asking for them: two processes sharing one GPU is a launch mistake, not a plan.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} has no GPU: this host shows {count} "
            f"(CUDA_VISIBLE_DEVICES or --gpus lists fewer GPUs than --nproc_per_node)"
        )
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones: the collectives run the same code either way."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(
    init_method: Optional[str],
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: float,
    what: str,
    store: Optional[SharedStore] = None,
) -> Optional[dist.ProcessGroup]:
    """The default process group of ``world_size`` processes meeting at ``init_method``; None for one.

    ``store`` (a job-wide store, see :mod:`trainer.node.rendezvous`) replaces
    ``init_method``: the group then keeps its keys under the store's prefix.
    Uses the default group when the script already made one of this size
    (torchrun users often do); otherwise makes it. ``timeout`` bounds every
    collective, so a process that died fails the others instead of hanging them.
    """
    if world_size == 1:
        return None
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            hint = (
                "; with pservers each trainer node is a process group of its own, which the Trainer makes: "
                "do not call init_process_group for the whole job"
                if store is not None
                else ""
            )
            raise ValueError(
                f"{what}: torch.distributed is already initialised with {dist.get_world_size()} "
                f"processes, expected {world_size}{hint}"
            )
        return dist.group.WORLD
    if init_method is None and store is None:
        raise ValueError(
            f"{what}: {world_size} processes need a rendezvous: set MASTER_ADDR and MASTER_PORT "
            f"(ps-launch and torchrun do), or pass init_method='tcp://host:port'"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deadline = datetime.timedelta(seconds=timeout)
    if store is not None:
        log.info(
            "%s: joining the node's process group as rank %d of %d %s (%s)",
            what,
            rank,
            world_size,
            store.describe(),
            backend_for(device),
        )
        dist.init_process_group(
            backend_for(device),
            store=open_store(store, deadline, what),
            rank=rank,
            world_size=world_size,
            timeout=deadline,
        )
        return dist.group.WORLD
    log.info(
        "%s: joining the process group at %s as rank %d of %d (%s)",
        what,
        init_method,
        rank,
        world_size,
        backend_for(device),
    )
    dist.init_process_group(
        backend_for(device), init_method=init_method, rank=rank, world_size=world_size, timeout=deadline
    )
    return dist.group.WORLD


def open_store(spec: SharedStore, timeout: datetime.timedelta, what: str) -> dist.Store:
    """The job's store (hosted here when ``spec.is_master``), seen through the node's prefix.

    A client waits up to ``timeout`` for the store to answer; past it, the error says who should host it.
    """
    try:
        base = dist.TCPStore(
            spec.host,
            spec.port,
            is_master=spec.is_master,
            timeout=timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
    except RuntimeError as e:  # torch's DistNetworkError / DistStoreError
        host = (
            "this process (the job's RANK 0) could not host it"
            if spec.is_master
            else "it did not answer: torchrun's agent on node rank 0 (TORCHELASTIC_USE_AGENT_STORE=True) "
            "or the job's RANK 0 hosts it"
        )
        raise RuntimeError(
            f"{what}: the job's store at {spec.host}:{spec.port} (MASTER_ADDR:MASTER_PORT): {host} ({e})"
        ) from None
    return dist.PrefixStore(spec.prefix, base)
