"""CollectiveTrainer: collective ("nccl2") mode, where trainers all-reduce among themselves and no pserver
runs.

Every process of every trainer node holds the whole model, wrapped in
``torch.nn.parallel.DistributedDataParallel``: the backward pass all-reduces (averages) the gradients in
fused buckets of ``bucket_cap_mb``, and each process then steps the program's optimizer (and lr scheduler)
itself. With N processes each on a batch of b examples and a mean loss, k steps equal single-process
training on the concatenated batches of N·b examples.

The public surface matches :class:`trainer.Trainer`, so one training script serves both modes; what needs
pservers (checkpoints on pservers, distributed tables) is not there: asking for it raises an AttributeError
naming collective mode.

Processes and devices: ``trainers`` in the plan counts trainer nodes; each runs ``local_world_size``
processes (``LOCAL_WORLD_SIZE``, torchrun's or ``ps-launch --nproc_per_node``'s variable), so the job has
``trainers * local_world_size`` processes, the global rank of local rank ``l`` of node ``t`` being ``t *
local_world_size + l`` unless ``RANK`` says otherwise. Each process computes on ``cuda:LOCAL_RANK`` when
CUDA is there (NCCL), on the CPU otherwise (gloo). The trainer moves the model to
:attr:`CollectiveTrainer.device`; batches must be moved by the caller (``x.to(tr.device)``).

Hierarchical all-reduce (Paddle's ``use_hierarchical_allreduce``) is not an option: DDP offers no such
switch, and NCCL already picks topology-aware rings and trees itself. The nearest torch offers is Local
SGD's two levels (gradients all-reduced inside a node every step, parameters averaged over all nodes every
``local_sgd_steps``), which ``use_local_sgd`` turns on.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Callable, Dict, Iterable, Iterator, Mapping, Optional, Tuple

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from transpiler import TrainerProgram
from transpiler.optim import LR_SCHEDULERS
from transpiler.roles.role_env import NodeEnv

from .feed import Feed
from .node.devices import backend_for, join_group, pick_device
from .trainer_base import TrainerBase

log = logging.getLogger(__name__)

# What a PserverTrainer offers that needs pservers, and what to do instead in collective mode.
PSERVER_ONLY = {
    "checkpoint": "save state_dict() yourself (e.g. on rank 0)",
    "save_tables": "use mode='pserver' for distributed tables",
    "prefetch": "use mode='pserver' for distributed tables",
    "pull_rows": "use mode='pserver' for distributed tables",
}


def _ranks(
    program: TrainerProgram,
    env: NodeEnv,
    environ: Mapping[str, str],
    local_rank: Optional[int],
    local_world_size: Optional[int],
) -> Tuple[int, int, int, int]:
    """(local_rank, local_world_size, rank, world_size) of this process; explicit arguments win over the env.

    Raises ValueError when the job's size from the environment disagrees with
    the plan: collective mode runs ``trainers * local_world_size`` processes.
    """
    lws = env.local_world_size if local_world_size is None else local_world_size
    lrank = env.local_rank if local_rank is None else local_rank
    if isinstance(lws, bool) or not isinstance(lws, int) or lws < 1:
        raise ValueError(f"local_world_size must be an int >= 1, got {lws!r}")
    if isinstance(lrank, bool) or not isinstance(lrank, int) or not 0 <= lrank < lws:
        raise ValueError(f"local_rank {lrank!r} is out of range [0, local_world_size={lws})")
    world_size = program.trainers * lws
    if local_world_size is None and environ.get("WORLD_SIZE") and env.world_size != world_size:
        raise ValueError(
            f"WORLD_SIZE={env.world_size}, but collective mode runs trainers ({program.trainers}, "
            f"PADDLE_TRAINERS_NUM: trainer nodes) x LOCAL_WORLD_SIZE ({lws}, processes per node) = "
            f"{world_size} processes; make them agree"
        )
    rank = program.trainer_id * lws + lrank
    if local_rank is None and environ.get("RANK") and env.rank != rank:
        # torchrun numbers nodes itself; its RANK is what the other processes use, so it wins.
        log.warning(
            "RANK=%d is not trainer_id (%d) * local_world_size (%d) + local_rank (%d) = %d; using RANK",
            env.rank,
            program.trainer_id,
            lws,
            lrank,
            rank,
        )
        rank = env.rank
    return lrank, lws, rank, world_size


def narrow_all_reduce_hook(dtype: torch.dtype, bucket):  # no annotations: DDP checks them, as objects
    """DDP communication hook: the bucket cast to ``dtype`` and divided by the world size, all-reduced,
    widened.

    torch's ``bf16_compress_hook`` does the same, but DDP accepts it only over NCCL; this one runs on every
    backend, gloo included. Returns the future of the widened bucket.
    """
    buffer = bucket.buffer()
    narrow = buffer.to(dtype).div_(dist.get_world_size())
    fut = dist.all_reduce(narrow, async_op=True).get_future()

    def widened(fut) -> torch.Tensor:
        return buffer.copy_(fut.value()[0])

    return fut.then(widened)


class CollectiveTrainer(TrainerBase):
    """One process of a collective-mode job (what ``Trainer(program)`` makes for one): DDP over all processes.

    Construction joins the process group of all ``trainers * local_world_size``
    processes (at ``init_method``, default ``tcp://MASTER_ADDR:MASTER_PORT``;
    a default group the script already made is used as is), moves the model
    to :attr:`device` and wraps it in DDP, which broadcasts rank 0's
    parameters so every process starts from the same ones. :attr:`model` is
    the DDP module while open (forward through it, so the backward
    all-reduces) and the plain module after :meth:`close`; :attr:`module` is
    always the plain one. Evaluate on one rank only with :attr:`module` or
    under ``torch.no_grad()``. ``security`` is accepted for parity with
    :class:`trainer.Trainer` and unused: torch.distributed traffic is not
    encrypted.
    """

    def __init__(
        self,
        program: TrainerProgram,
        security=None,
        local_rank: Optional[int] = None,
        local_world_size: Optional[int] = None,
        init_method: Optional[str] = None,
    ):
        super().__init__(program)
        if not program.collective:
            raise ValueError(
                f"the TrainerProgram is in {program.config.mode!r} mode; CollectiveTrainer "
                f"trains mode='collective' programs (use trainer.Trainer for pservers)"
            )
        if security is not None:
            log.warning("collective mode: security is ignored; torch.distributed traffic is not encrypted")
        self.sync_mode = True
        env = NodeEnv.from_env()
        self.local_rank, self.local_world_size, self.rank, self.world_size = _ranks(
            program, env, os.environ, local_rank, local_world_size
        )
        self.device = pick_device(self.local_rank)
        # batches(): the data position, and the next item read ahead (read_ahead).
        self.feed = Feed(self.state, self.pull, None, program.config.read_ahead)
        self._owns_group = not dist.is_initialized()
        self._join(init_method or env.init_method, program.config.barrier_timeout)
        try:
            self._build(program)
            self._open_board(
                "step_time/optimizer_ms"
            )  # TensorBoard (docs/tensorboard.md); no pservers to ask
        except BaseException:
            self._leave()
            raise
        log.info(
            "collective trainer %d: rank %d of %d (local rank %d of %d) on %s, %s, buckets of %s MiB%s",
            self.trainer_id,
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.device,
            backend_for(self.device),
            program.config.bucket_cap_mb,
            f", Local SGD every {program.config.local_sgd_steps} steps after "
            f"{program.config.local_sgd_warmup_steps} warm-up steps"
            if program.config.use_local_sgd
            else "",
        )

    def _join(self, init_method: Optional[str], timeout: float) -> None:
        """Join (or make) the default process group; a one-process job gets an in-memory one.

        DDP needs a process group even alone, so a single process makes one
        over a ``HashStore`` instead of asking for a rendezvous address.
        """
        what = f"collective trainer {self.trainer_id} (rank {self.rank})"
        if self.world_size > 1:
            join_group(init_method, self.rank, self.world_size, self.device, timeout, what)
        elif dist.is_initialized():
            if dist.get_world_size() != 1:
                raise ValueError(
                    f"{what}: torch.distributed is already initialised with "
                    f"{dist.get_world_size()} processes, the plan says 1"
                )
        else:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            dist.init_process_group(
                backend_for(self.device),
                store=dist.HashStore(),
                rank=0,
                world_size=1,
                timeout=datetime.timedelta(seconds=timeout),
            )
        if dist.get_rank() != self.rank:
            self._leave()
            raise ValueError(
                f"{what}: the process group numbers this process {dist.get_rank()}, the plan "
                f"and environment say rank {self.rank}"
            )

    def _build(self, program: TrainerProgram) -> None:
        """DDP around the model on its device, the optimizer, the scheduler and Local SGD."""
        config = program.config
        self.module = program.model.to(self.device)
        self.model = DistributedDataParallel(
            self.module,
            device_ids=[self.device] if self.device.type == "cuda" else None,
            bucket_cap_mb=config.bucket_cap_mb,
        )
        # Built on the moved parameters: Module.to() keeps the Parameter objects, changing their data.
        base = program.optimizer.build([p for p in self.module.parameters() if p.requires_grad])
        spec = program.optimizer
        # The scheduler drives the plain optimizer: a Local SGD wrapper shares its param_groups (and lr).
        self.scheduler = (
            LR_SCHEDULERS[spec.lr_scheduler](base, **spec.lr_scheduler_kwargs) if spec.lr_scheduler else None
        )
        self.optimizer = base
        self._subgroup = None
        if config.use_local_sgd:
            self.optimizer = self._local_sgd(base, config.local_sgd_steps, config.local_sgd_warmup_steps)
        elif config.grad_wire_dtype is not None:  # all-reduce buckets in half the bytes
            self.model.register_comm_hook(getattr(torch, config.grad_wire_dtype), narrow_all_reduce_hook)

    def _local_sgd(self, base: torch.optim.Optimizer, period: int, warmup: int) -> torch.optim.Optimizer:
        """Register torch's post-local-SGD hook and wrap ``base`` in ``PostLocalSGDOptimizer``."""
        from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
            PostLocalSGDState,
            post_localSGD_hook,
        )
        from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
        from torch.distributed.optim import PostLocalSGDOptimizer

        # The node's processes, made here: torch's default (subgroup=None) sizes subgroups by
        # torch.cuda.device_count(), which fails on CPU and is wrong when a node runs fewer
        # processes than it has GPUs. Global ranks are node-major, so consecutive ranks share a node.
        self._subgroup, _ = dist.new_subgroups(group_size=self.local_world_size)
        state = PostLocalSGDState(process_group=None, subgroup=self._subgroup, start_localSGD_iter=warmup)
        self.model.register_comm_hook(state, post_localSGD_hook)
        return PostLocalSGDOptimizer(base, averager=PeriodicModelAverager(period=period, warmup_steps=warmup))

    # -- public -------------------------------------------------------------

    def step(self, scaler: Optional[torch.amp.GradScaler] = None) -> int:
        """Step the optimizer on the all-reduced gradients, then the lr scheduler, and zero the gradients.

        Returns the number of steps taken so far. With a ``torch.amp.GradScaler``
        (fp16 autocast) the step goes through ``scaler.step(optimizer)`` and
        ``scaler.update()``, which skip a step whose gradients overflowed; the
        gradients were all-reduced before, so every process skips alike.
        """
        self._check_open()
        self.board.step_begins()
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.module.zero_grad(set_to_none=True)
        self.state.advance(self.state.step + 1, self.state.next_position())
        self.board.step_ends(self.state.step)
        return self.state.step

    def pull(self) -> None:
        """Nothing to pull: every process holds the current parameters (kept for parity with Trainer)."""
        self._check_open()

    def state_dict(self, with_tables: bool = False) -> Dict[str, torch.Tensor]:
        """The trained model as a plain ``state_dict`` (no DDP ``module.`` prefix), on :attr:`device`.

        ``with_tables`` changes nothing: collective mode has no distributed tables.
        """
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def batches(
        self, loader: Iterable, epochs: int, prefetch: Optional[Callable[[object], Dict[str, object]]] = None
    ) -> Iterator:
        """The items of ``loader`` for ``epochs`` epochs, from :attr:`position` on; train one step per item.

        Calls ``loader.sampler.set_epoch(epoch)`` when there is one (see
        :meth:`sampler`), and keeps :attr:`position` at (epoch, batches done)
        after each :meth:`step`, as :class:`trainer.Trainer` does (reading the
        next item on a background thread with ``read_ahead``). ``prefetch``
        needs distributed tables, which collective mode has not.
        """
        if prefetch is not None:
            self._no_pservers("batches(prefetch=...)", "use mode='pserver' for distributed tables")
        return super().batches(loader, epochs)

    def __getattr__(self, name: str):
        """Only for names not found otherwise: a pserver-mode method gets an error naming collective mode."""
        if name in PSERVER_ONLY:
            raise AttributeError(self._needs_pservers(f"{name}()", PSERVER_ONLY[name]), name=name, obj=self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}", name=name, obj=self)

    def close(self) -> None:
        """Leave the job: destroy the process group this trainer made; :attr:`model` becomes the plain module.

        Idempotent. A default group the script made itself is left to it.
        """
        super().close()

    def _close(self, patient: bool) -> None:
        self.model = self.module  # the DDP wrapper cannot communicate once its group is gone
        self.board.close(self.state.step, patient)
        self.feed.close()
        self._leave()
        log.info(
            "collective trainer %d (rank %d): closed after step %d",
            self.trainer_id,
            self.rank,
            self.step_count,
        )

    def _leave(self) -> None:
        """Destroy the groups this trainer made (the default one only if it made it)."""
        if not dist.is_initialized():
            return
        if self._owns_group:
            dist.destroy_process_group()  # takes the Local SGD subgroups with it
        elif getattr(self, "_subgroup", None) is not None:
            dist.destroy_process_group(self._subgroup)
        self._subgroup = None

    def _no_pservers(self, what: str, instead: str):
        raise RuntimeError(self._needs_pservers(what, instead))

    def _needs_pservers(self, what: str, instead: str) -> str:
        mode = self.program.config.mode
        return f"{what} needs pservers, and collective mode (mode={mode!r}) has none; {instead}"

    @property
    def _name(self) -> str:
        return f"collective trainer {self.trainer_id} (rank {self.rank})"
