"""PserverTrainer: runs the model locally, keeps its parameters in step with the pservers.

A facade: the public API and the wiring of its parts. How a step goes (with
or without the async pipeline, on a node of several local processes) is one
:mod:`stepper <trainer.steppers>` chosen here at construction.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Dict, Iterable, Iterator, List, Optional

import torch

from transpiler import TrainerProgram
from transpiler.layout.starting import trainer_program_now
from transpiler.roles.role_env import NodeEnv

from .blocks import LocalBlocks
from .embedding import install_tables
from .feed import Feed
from .heartbeat import Heartbeat
from .layout_changes import FollowsLayout
from .node import pick_device
from .recovery import Recovery
from .steppers.geo import GeoStepper
from .steppers.local import LocalStepper
from .steppers.node import NodeStepper
from .steppers.pipelined import PipelinedStepper
from .steppers.stepper import Stepper
from .trainer_base import TrainerBase
from .transport import Channels

log = logging.getLogger(__name__)


class PserverTrainer(FollowsLayout, TrainerBase):
    """One trainer of a pserver-mode program (what ``Trainer(program)`` makes for one).

    On construction it waits for every pserver (logging "waiting for <endpoint>"
    until ``connect_timeout``), registers, and pulls the initial parameters into
    ``program.model``. Each :meth:`step` pushes the gradients of every block to
    its pserver and pulls the updated parameters, all pservers in parallel; in
    sync mode the pull returns once every live trainer's gradient for the step
    was applied. Call :meth:`close` (or use ``with``) when done, so the
    pservers stop waiting for this trainer.

    In async mode with ``async_pipeline`` on, :meth:`step` sends
    in the background and returns at once; the parameters it pulls are
    installed by the next :meth:`step` (or :meth:`pull`, :meth:`close`).

    Every distributed table of the program is replaced in ``model`` by a
    :class:`~trainer.embedding.DistributedEmbedding`: lookups fetch rows from
    the pservers and :meth:`step` pushes the rows' gradients with the dense ones.

    A trainer *node* may run several local processes, one per GPU
    (``local_rank`` of ``local_world_size``; by default from ``LOCAL_RANK`` and
    ``LOCAL_WORLD_SIZE`` as torchrun and ``ps-launch --nproc_per_node`` set
    them). Each trains on its own batches; the node's gradients are reduced
    among them (:mod:`trainer.node`) and the pservers see one trainer. Their
    process group meets at ``init_method`` (default ``tcp://MASTER_ADDR:MASTER_PORT``;
    under a torchrun across nodes, whose store there is the job's, each node
    keeps its group's keys under a prefix of its own: :mod:`trainer.node.rendezvous`).
    The Trainer moves the model to :attr:`device`: ``cuda:<local rank>``
    when CUDA is there, else the CPU; move each batch there too.
    """

    def __init__(
        self,
        program: TrainerProgram,
        security=None,
        local_rank: Optional[int] = None,
        local_world_size: Optional[int] = None,
        init_method: Optional[str] = None,
    ):
        program = trainer_program_now(program)  # a job that changed its pserver count runs another layout
        super().__init__(program)
        node = NodeEnv.from_env()
        self.local_rank = node.local_rank if local_rank is None else local_rank
        self.local_world_size = node.local_world_size if local_world_size is None else local_world_size
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank={self.local_rank} is out of range [0, local_world_size={self.local_world_size})"
            )
        self.rank = self.trainer_id * self.local_world_size + self.local_rank
        self.world_size = program.trainers * self.local_world_size
        cfg = program.config
        self.device = pick_device(self.local_rank)
        self.model = program.model
        self.sync_mode = program.sync_mode
        self._security, self._init_method = security, init_method  # what a change of layout rebuilds with
        self.blocks = LocalBlocks(program, self.model)
        self.channels = Channels(program, security)
        self.recovery = self._recovery(program)
        self.stepper: Optional[Stepper] = None
        try:
            self.stepper = self._stepper(init_method)
            self.tables = self.stepper.tables
            # batches(): the data position, and the next batch read (and its table ids planned) ahead.
            plan_next = (
                self.stepper.plan_next_batch if program.tables and self.local_world_size == 1 else None
            )
            self.feed = Feed(self.state, self._pull, plan_next, cfg.read_ahead, self.stepper.end_epoch)
            self.stepper.join()
            self.tables.follow_moves(self._adopt_moved)
            # Last, so a Trainer that failed to connect leaves the model as it was.
            install_tables(self.model, program.tables, self.tables, self.device)
            if self.device.type != "cpu":  # after the tables left: their modules may sit on the meta device
                self.model.to(self.device)
            # TensorBoard (docs/tensorboard.md): trainer 0's first process also writes the pservers' Stats.
            # The board asks the channels of the layout it is in (a change of pserver count replaces them).
            self._open_board(
                "step_time/push_pull_ms", lambda t: self.channels.stats(t), list(program.pservers)
            )
        except BaseException:
            if self.feed is not None:
                self.feed.close()
            if self.stepper is not None:
                self.stepper.close(None)
            else:
                self.channels.shutdown()
            raise
        self._heartbeat = self._start_heartbeat()
        log.info(
            "trainer %d%s: ready at step %d (data position epoch %d batch %d), %s, %d blocks on %d pservers",
            self.trainer_id,
            self._local,
            self.step_count,
            *self.position,
            type(self.stepper).__name__,
            len(self.blocks.by_name),
            len(self.blocks.by_endpoint),
        )

    def _recovery(self, program: TrainerProgram, new_layout: bool = False) -> Recovery:
        """How this trainer heals with the pservers of ``program``: it pushes every step to each pserver
        that owns blocks or table shards, even with nothing for it, so sync barriers count it (with backup
        trainers the first pserver, which decides each step's trainers, steps with the others).
        ``new_layout``: a layout just adopted (see :class:`Recovery`)."""
        cfg = program.config
        push_endpoints = (
            list(program.pservers) if program.tables or cfg.backup_trainers else list(self.blocks.by_endpoint)
        )
        return Recovery(
            self.channels,
            self.sync_mode,
            push_endpoints,
            cfg.connect_timeout,
            cfg.recovery_timeout,
            new_layout=new_layout,
        )

    def _start_heartbeat(self) -> Optional[Heartbeat]:
        """Heartbeats to the pservers of the plan while this trainer is silent towards them, started; None
        for a node's processes other than its leader (which heartbeats for the node)."""
        if not self.stepper.speaks_for_trainer:
            return None
        cfg = self.program.config
        return Heartbeat(
            self.channels, self.program.pservers, cfg.heartbeat_interval, cfg.heartbeat_timeout
        ).start()

    def _stepper(self, init_method: Optional[str]) -> Stepper:
        """The stepper this trainer's plan and process ask for (see :mod:`trainer.steppers.stepper`)."""
        cfg = self.program.config
        parts = (self.program, self.model, self.channels, self.blocks, self.recovery, self.state)
        if (cfg.k_steps or cfg.backup_trainers) and self.local_world_size > 1:
            mode = (
                f"GEO mode (k_steps={cfg.k_steps})"
                if cfg.k_steps
                else f"backup_trainers={cfg.backup_trainers}"
            )
            raise ValueError(
                f"{mode} trains one process per trainer; this trainer node has local_world_size="
                f"{self.local_world_size}: start one trainer per process instead"
            )
        if cfg.k_steps:
            return GeoStepper(*parts)
        if self.local_world_size > 1:
            return NodeStepper(
                *parts,
                local_rank=self.local_rank,
                local_world_size=self.local_world_size,
                device=self.device,
                init_method=init_method,
            )
        if not self.sync_mode and cfg.async_pipeline:
            return PipelinedStepper(*parts)
        return LocalStepper(
            *parts, push_during_backward=cfg.push_during_backward and self.device.type == "cpu"
        )

    @property
    def _local(self) -> str:
        return f" local rank {self.local_rank}/{self.local_world_size}" if self.local_world_size > 1 else ""

    @property
    def _name(self) -> str:
        return f"trainer {self.trainer_id}{self._local}"

    # -- public -------------------------------------------------------------

    def step(self, prefetch: Optional[Dict[str, object]] = None) -> int:
        """Push this step's gradients, wait (sync), pull fresh parameters, zero grads.

        Returns the number of steps taken so far. Parameters without a
        gradient this step are not pushed (the pserver skips them, as torch
        does in single-process training); distributed tables push the
        gradients of the rows this step looked up. ``prefetch`` ({table: ids}
        of the *next* batch; :meth:`batches` passes it when given a
        ``prefetch`` function) rides along with the push: each pserver answers
        with their rows as of after this step, so the next step's lookups need
        no round trip of their own (sync: exactly the rows a lookup would find).
        """
        self._check_open()
        self.board.step_begins()
        self._step_in_layout(prefetch)
        self.board.step_ends(self.state.step)
        return self.state.step

    def pull(self) -> None:
        """Refresh the local parameters from the pservers now (async: latest; sync: current step).

        A pserver lost meanwhile is waited for and re-synced with, as in a step;
        in sync mode that may move this trainer to another step (a roll-back:
        :meth:`batches` then replays the data since the checkpoint).
        """
        self._check_open()
        self._pull()

    def state_dict(self, with_tables: bool = False) -> Dict[str, torch.Tensor]:
        """The trained model as a plain ``state_dict`` (fresh parameters, local buffers).

        Distributed tables are left out (they may not fit in memory; see
        :meth:`save_tables`), unless ``with_tables``: then each table's rows
        ``0 .. num_embeddings-1`` are pulled as ``"<table>.weight"``, and the
        result loads into the original module with ``load_state_dict``. Call
        it before :meth:`close`.
        """
        self.pull()
        state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        if with_tables:
            for spec in self.program.tables:
                state[f"{spec.name}.weight"] = self.pull_rows(spec.name, torch.arange(spec.capacity))
        return state

    def pull_rows(self, table: str, ids) -> torch.Tensor:
        """Current rows of distributed ``table`` for ``ids`` (any int64, any shape): ``ids.shape + (dim,)``.

        Ids never trained come back with their initial value. Sync mode reads
        the rows as of this trainer's current step.
        """
        self._check_open()
        return self.tables.pull_rows(table, ids)

    def prefetch(self, ids: Dict[str, object]) -> None:
        """Fetch the rows of several tables (``{table: ids}``) in one round trip per pserver.

        Optional: the next lookups of these ids in this step use the fetched
        rows instead of fetching per lookup. Worth it when a forward looks up
        several tables.
        """
        self._check_open()
        self.tables.prefetch(ids)

    def save_tables(self, directory: str) -> List[str]:
        """Every pserver writes its table shards under ``directory`` (on its own file system).

        Shards land in ``directory/<table>/shard-K-of-N``; a pserver started
        with ``tables_from=directory`` (any number of pservers) resumes from
        them, and ``python -m pserver.tables.cli DIRECTORY OUT`` exports them as
        one ids/rows file set per table. Returns the shard directories written.
        """
        self._check_open()
        self.stepper.flush()  # the saved rows include this trainer's last step

        def save() -> List[str]:
            replies = self.channels.run_parallel(
                {
                    ep: functools.partial(self.channels[ep].save_tables, directory)
                    for ep in self.program.pservers
                }
            )
            return [p for reply in replies.values() for p in reply.paths]

        return self.stepper.leader_does("save_tables", save)

    def batches(
        self, loader: Iterable, epochs: int, prefetch: Optional[Callable[[object], Dict[str, object]]] = None
    ) -> Iterator:
        """The items of ``loader`` for ``epochs`` epochs, from this trainer's data position on.

        Train one step per item. A new trainer starts at epoch 0, batch 0; one
        that (re)joins a job, or a job resumed from a checkpoint, starts where
        the pservers say this trainer's data stood, skipping the batches
        before it. Calls ``loader.sampler.set_epoch(epoch)`` when there is one
        (``DistributedSampler``, see :meth:`sampler`), so a shuffled epoch
        replays in the same order. When pservers roll back to a checkpoint
        (sync), the batches since it are trained again, as if no failure had
        happened; the position travels with every push and lands in checkpoints.

        With ``read_ahead`` (the default) the next item is read from the
        loader on a background thread while the current one trains.
        ``prefetch(item)`` ({table: ids} of an item) sends the next item's ids
        with each :meth:`step`'s push, and their rows come back with its
        answer (see :meth:`step`); they are deduplicated and routed on that
        thread too.
        """
        return super().batches(loader, epochs, prefetch)

    def checkpoint(self) -> List[str]:
        """Every pserver writes its part of a checkpoint now; returns the part directories.

        Needs ``checkpoint_dir``. In sync mode, between two of this trainer's
        steps every pserver is at the same step, so the parts make one model.
        """
        self._check_open()
        self.stepper.flush()

        def checkpoint() -> List[str]:
            replies = self.channels.run_parallel(
                {ep: self.channels[ep].checkpoint for ep in self.program.pservers}
            )
            return [replies[ep].path for ep in self.program.pservers]

        return self.stepper.leader_does("checkpoint", checkpoint)

    def close(self) -> None:
        """Tell every pserver this trainer is done and release connections. Idempotent.

        A pserver that died under the Close (or is down) gets it again once it is back, for up to
        ``connect_timeout`` s: restarted from a checkpoint older than this Close, it would wait for this
        trainer. Leaving a ``with`` block on an exception closes without waiting.
        """
        super().close()

    def _close(self, patient: bool) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop()
        try:
            self.stepper.finish()  # the last step reaches the pservers before Close
        except BaseException:
            patient = False  # the job failed here: say so quickly, do not wait for pservers
            raise
        finally:
            try:  # the last scalars (and pserver Stats) while the channels are open; then flushed
                self.board.close(self.state.step, patient)
            finally:
                self.feed.close()
                self.stepper.close(self.program.config.connect_timeout if patient else 0.0)
        log.info(
            "trainer %d%s: closed after step %d (pushed %s bytes, pulled %s bytes)",
            self.trainer_id,
            self._local,
            self.step_count,
            f"{self.channels.bytes_pushed:,}",
            f"{self.channels.bytes_pulled:,}",
        )
