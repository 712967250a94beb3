"""Which device a trainer process computes on, and the process group its node's processes share."""
from __future__ import annotations

import datetime
import logging
from typing import Optional

import torch
import torch.distributed as dist

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
        raise ValueError(f"local rank {local_rank} has no GPU: this host shows {count} "
                         f"(CUDA_VISIBLE_DEVICES or --gpus lists fewer GPUs than --nproc_per_node)")
    return torch.device("cuda", local_rank)


def backend_for(device: torch.device) -> str:
    """NCCL for CUDA tensors, gloo for CPU ones: the collectives run the same code either way."""
    return "nccl" if device.type == "cuda" else "gloo"


def join_group(init_method: Optional[str], rank: int, world_size: int, device: torch.device,
               timeout: float, what: str) -> Optional[dist.ProcessGroup]:
    """The default process group of ``world_size`` processes meeting at ``init_method``; None for one.

    Uses the default group when the script already made one of this size
    (torchrun users often do); otherwise makes it. ``timeout`` bounds every
    collective, so a process that died fails the others instead of hanging them.
    """
    if world_size == 1:
        return None
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(f"{what}: torch.distributed is already initialised with {dist.get_world_size()} "
                             f"processes, expected {world_size}")
        return dist.group.WORLD
    if init_method is None:
        raise ValueError(f"{what}: {world_size} processes need a rendezvous: set MASTER_ADDR and MASTER_PORT "
                         f"(ps-launch and torchrun do), or pass init_method='tcp://host:port'")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    log.info("%s: joining the process group at %s as rank %d of %d (%s)", what, init_method, rank, world_size,
             backend_for(device))
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout))
    return dist.group.WORLD
