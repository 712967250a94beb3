"""Trainer: runs the model locally, keeps its parameters in step with the pservers."""
from __future__ import annotations

import logging
import os
from concurrent import futures
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import Dataset, DistributedSampler

from transpiler import TrainerProgram
from transpiler.env import NodeEnv
from transpiler.position import Position

from .blocks import LocalBlocks
from .communicator import Communicator
from .errors import PserverError
from .embedding import AheadPlan, Pieces, TableClient, install_tables, prefetch_all, zero_rows
from .feed import Feed
from .heartbeat import Heartbeat
from .node import REPLAY, Layout, NodeGroup, NodeSteps, join_group, node_rendezvous, pick_device
from .overlap import BackwardPush
from .recovery import ROLLBACK, Decision, Recovery, recoverable


log = logging.getLogger(__name__)


class Trainer:
    """One trainer of a transpiled program.

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

    A collective plan (``DistributeTranspilerConfig(mode="collective")``)
    makes a :class:`~trainer.collective.CollectiveTrainer` instead: DDP, no pservers.
    """

    def __new__(cls, program=None, *args, **kwargs):
        # One script serves both modes: a collective plan trains with DDP and no pservers.
        if cls is Trainer and isinstance(program, TrainerProgram) and program.collective:
            from .collective import CollectiveTrainer
            return CollectiveTrainer(program, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, program: TrainerProgram, security=None, local_rank: Optional[int] = None,
                 local_world_size: Optional[int] = None, init_method: Optional[str] = None):
        if not isinstance(program, TrainerProgram):
            raise TypeError(f"program must be a TrainerProgram, got {type(program).__name__}")
        if program.model is None:
            raise ValueError("the TrainerProgram carries no model; pass model= to TrainerProgram.from_bytes")
        node = NodeEnv.from_env()
        self.local_rank = node.local_rank if local_rank is None else local_rank
        self.local_world_size = node.local_world_size if local_world_size is None else local_world_size
        if not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(f"local_rank={self.local_rank} is out of range [0, local_world_size="
                             f"{self.local_world_size})")
        self.program = program
        self.device = pick_device(self.local_rank)
        self.model = program.model
        self.trainer_id = program.trainer_id
        self.sync_mode = program.sync_mode
        self.blocks = LocalBlocks(program, self.model)
        # Every step pushes to each pserver that owns blocks or table shards,
        # even with nothing for it, so sync barriers count this trainer.
        self._push_endpoints = list(program.pservers) if program.tables else list(self.blocks.by_endpoint)
        self._closed = False
        # Async pipeline: the step being sent in the background; its pulled
        # blocks wait in self.blocks' staging buffers until the next step().
        self._pipelined = not self.sync_mode and program.config.async_pipeline and self.local_world_size == 1
        self._sender = futures.ThreadPoolExecutor(1, thread_name_prefix="trainer-send") \
            if self._pipelined else None
        self._in_flight: Optional[futures.Future] = None
        self.comm = Communicator(program, security)
        self.recovery = Recovery(self.comm, self.sync_mode, self._push_endpoints,
                                 program.config.connect_timeout, program.config.recovery_timeout)
        self.tables = TableClient(program.tables, program.pservers, self._fetch_rows,
                                  lambda: self.step_count if self.sync_mode else 0)
        self._discard_step = False
        self._lookup_error: Optional[PserverError] = None
        # Streams opened during backward (BackwardPush): per pserver, the table rows asked ahead and got.
        self._stream_rows: Dict[str, Tuple[Dict[str, tuple], Dict[str, torch.Tensor]]] = {}
        self.node: Optional[NodeSteps] = None
        self._own_group = False
        # batches(): the data position, and the next batch read (and its table ids prepared) ahead.
        self.feed = Feed(lambda: self.position, self._set_position, self.pull,
                         self._prepare_ahead if program.tables and self.local_world_size == 1 else None,
                         program.config.read_ahead)
        try:
            if self.local_world_size > 1:
                self._join_node(init_method)
            self._join()
            # Last, so a Trainer that failed to connect leaves the model as it was.
            install_tables(self.model, self.program.tables, self.tables, self.device)
            if self.device.type != "cpu":  # after the tables left: their modules may sit on the meta device
                self.model.to(self.device)
        except BaseException:
            self.comm.shutdown()
            self.feed.close()
            self._leave_group()
            raise
        self._overlap: Optional[BackwardPush] = None
        if program.config.push_during_backward and self.node is None and not self._pipelined \
                and self.device.type == "cpu":
            self._overlap = BackwardPush(self.blocks, self.model, self._push_endpoints, self._start_stream)
        self._heartbeat = None
        if self.node is None or self.node.group.is_leader:  # the node's leader speaks for it
            self._heartbeat = Heartbeat(self.comm, program.pservers, program.config.heartbeat_interval).start()
        log.info("trainer %d%s: ready at step %d (data position epoch %d batch %d), %d blocks on %d "
                 "pservers", self.trainer_id, self._local, self.step_count, *self.position,
                 len(self.blocks.by_name), len(self.blocks.by_endpoint))

    @property
    def _local(self) -> str:
        return f" local rank {self.local_rank}/{self.local_world_size}" if self.local_world_size > 1 else ""

    def _join_node(self, init_method: Optional[str]) -> None:
        """Meet the node's other local processes; they step as one trainer (see :mod:`trainer.node`).

        Where they meet comes from ``init_method`` or the environment (see
        :mod:`trainer.node.rendezvous`): an address of the node's own, or, under
        a torchrun across nodes, the job's store under this node's prefix.
        """
        cfg = self.program.config
        rendezvous = node_rendezvous(os.environ, self.trainer_id, self.local_world_size, init_method)
        self._own_group = not torch.distributed.is_initialized()
        # Local ranks wait in collectives while their leader re-syncs or a barrier holds: allow for both.
        timeout = max(cfg.barrier_timeout, cfg.recovery_timeout) + cfg.rpc_timeout
        group = join_group(rendezvous.init_method, self.local_rank, self.local_world_size, self.device, timeout,
                           f"trainer node {self.trainer_id} local rank {self.local_rank}", store=rendezvous.store)
        layout = Layout(self.blocks.by_endpoint, self.program.pservers, self.local_world_size)
        self.node = NodeSteps(NodeGroup(self.trainer_id, self.local_rank, layout, self.device, group), self.comm,
                              self.recovery, self.blocks, self._pull_all, cfg.recovery_timeout)

    def _leave_group(self) -> None:
        if self._own_group and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
            self._own_group = False

    def _join(self) -> None:
        """Register with every pserver and pull the parameters of the step they stand at.

        A pserver lost before the first pull is waited for and re-synced with,
        as in a step (see :class:`~trainer.recovery.Recovery`). On a node, its
        leader does it for every local rank.
        """
        if self.node is not None:
            self.step_count, self.position = self.node.join(self._join_alone)
            return
        self._join_alone()

    def _join_alone(self) -> Tuple[int, Position]:
        joined = self.recovery.join()
        self.position: Position = joined.position
        self.step_count = joined.step
        outcome = self.recovery.heal(self.step_count, "joining", lambda: self._pull_all(self.step_count),
                                     self._pull_all)
        if outcome is not None:
            self._resynced(outcome)
        return self.step_count, self.position

    def _fetch_rows(self, pieces: Pieces, min_updates: int) -> Dict[str, Dict[str, torch.Tensor]]:
        """Rows of ``pieces`` from the pservers, healing a failure as a step does.

        When healing moved this trainer to another step (sync: a roll-back, or
        the others went on), the rows come from there and the current batch's
        step is discarded: its forward began before the re-sync.
        """
        if self.node is not None:
            return self._fetch_rows_on_node(pieces, min_updates)
        fetched: Dict[str, Dict[str, torch.Tensor]] = {}
        outcome = self.recovery.heal(self.step_count, f"lookup at step {self.step_count}",
                                     lambda: fetched.update(prefetch_all(self.comm, self.tables, pieces, min_updates)),
                                     self._pull_all)
        if outcome is None:
            return fetched
        self._resynced(outcome)
        self._discard_step = True
        return prefetch_all(self.comm, self.tables, pieces, self.step_count if self.sync_mode else 0)

    def _fetch_rows_on_node(self, pieces: Pieces, min_updates: int) -> Dict[str, Dict[str, torch.Tensor]]:
        """A lookup of one local rank: a failure spoils the batch (zero rows), and the node heals at step()."""
        try:
            return prefetch_all(self.comm, self.tables, pieces, min_updates)
        except PserverError as e:
            if not recoverable(e):
                raise
            self._lookup_error = self._lookup_error or e
        return zero_rows(self.tables, pieces)

    # -- block views --------------------------------------------------------

    def _pull_from(self, endpoint: str, min_updates: int) -> int:
        names = [b.name for b in self.blocks.by_endpoint[endpoint]]
        return self.blocks.receive(
            lambda dest: self.comm.pull(endpoint, names, min_updates, self.blocks.expect, dest))

    def _pull_all(self, min_updates: int) -> None:
        self.comm.run_parallel({ep: (lambda ep=ep: self._pull_from(ep, min_updates))
                                for ep in self.blocks.by_endpoint})

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
        if self._discard_step:  # a lookup of this batch re-synced to another step: nothing to push
            self._discard_step = False
            if self._overlap is not None:
                self._overlap.abort()
            self.tables.clear()
            self.model.zero_grad(set_to_none=True)
            return self.step_count
        step = self.step_count
        position = self.feed.batch_position or Position(0, step + 1)
        if self.node is not None:
            return self._step_on_node(step, position)
        self._finish_in_flight()  # before the pinned gradient buffers (CUDA) are refilled
        sparse = self.tables.take_gradients() if self.program.tables else {}

        def grads(extra: Dict[str, list]) -> Dict[str, list]:
            return {ep: self.blocks.grads(ep) + sparse.get(ep, []) + extra.get(ep, []) for ep in self._push_endpoints}
        plan = self._prepare_ahead(prefetch) if prefetch and self.program.tables else self.feed.take_prepared()
        resync = None
        if self._pipelined:
            # The next forward runs before this push is answered: its rows were fetched ahead
            # while this batch trained (read_ahead), or its lookups fetch them.
            self._in_flight = self._sender.submit(self._send, step, grads({}), position)
            if plan is not None:
                self.tables.install_ahead(plan)
        else:
            ahead, expected = self.tables.ask_ahead(plan) if plan is not None else ({}, {})
            rows: Dict[str, Dict[str, torch.Tensor]] = {ep: {} for ep in ahead}
            streams = self._overlap is not None and self._overlap.started
            if streams:  # the blocks are on their way since backward: add the tables, end the streams
                for ep, (stream_expected, stream_rows) in self._stream_rows.items():
                    stream_expected.update(expected.get(ep, {}))
                    rows[ep] = stream_rows
                tail = {ep: sparse.get(ep, []) + ahead.get(ep, []) for ep in self._push_endpoints}

            def push_pull_all() -> None:
                nonlocal streams
                if streams:  # a retry after a failure sends everything again, as a plain push
                    streams = False
                    self._overlap.finish(tail)
                    return
                full = grads(ahead)  # gathered here: a step whose blocks streamed needs them only to retry
                self.comm.run_parallel({ep: (lambda ep=ep: self._push_pull(
                    ep, step, full[ep], position, expected.get(ep, {}), rows.setdefault(ep, {})))
                    for ep in self._push_endpoints})
            resync = self.recovery.heal(step, f"step {step}", push_pull_all, self._pull_all)
            if ahead and resync is None:
                self.tables.take_ahead(rows)
        # The pushed gradients stay referenced until sent; the next backward makes new ones.
        self.model.zero_grad(set_to_none=True)
        if resync is None:
            self.step_count = step + 1
            self.position = position
        else:
            self._resynced(resync)
        return self.step_count

    def _prepare_ahead(self, ids: Dict[str, object]) -> AheadPlan:
        """The next batch's ``{table: ids}`` made ready to send ahead (async pipeline: its rows fetched now)."""
        fetch = None
        if self._pipelined:
            def fetch(pieces: Pieces, min_updates: int):
                return prefetch_all(self.comm, self.tables, pieces, min_updates)
        return self.tables.plan_ahead(ids, fetch)

    def _set_position(self, position: Position) -> None:
        self.position = position

    def _start_stream(self, endpoint: str, tensors) -> futures.Future:
        """Open this step's push to ``endpoint`` fed by ``tensors`` as backward produces them (BackwardPush)."""
        step = self.step_count
        position = self.feed.batch_position or Position(0, step + 1)
        expected, rows = self._stream_rows[endpoint] = ({}, {})  # rows asked ahead join at step()
        return self.comm.submit(lambda: self._push_pull(endpoint, step, tensors, position, expected, rows,
                                                        streamed=True))

    def _push_pull(self, endpoint: str, step: int, tensors, position: Position,
                   expected_rows: Dict[str, tuple], rows: Dict[str, torch.Tensor], streamed: bool = False) -> int:
        """One pserver's push and answer: blocks into the parameters, asked-ahead table rows into ``rows``."""
        def expect(name: str):
            return self.blocks.expect(name) or expected_rows.get(name)

        def transfer(dest) -> int:
            def block_or_rows(name: str) -> torch.Tensor:
                if name in expected_rows:
                    dtype, shape = expected_rows[name]
                    rows[name] = torch.empty(shape, dtype=getattr(torch, dtype))
                    return rows[name]
                return dest(name)
            return self.comm.push_pull(endpoint, step, tensors, expect, block_or_rows, position, streamed)
        return self.blocks.receive(transfer)

    def _step_on_node(self, step: int, position: Position) -> int:
        """One step of a node's local rank: reduce, push and pull its share, gather (see NodeSteps)."""
        lookup_error, self._lookup_error = self._lookup_error, None

        def table_grads() -> Dict[str, list]:
            if not self.program.tables:
                return {}
            dims = {t.name: (t.dim, getattr(torch, t.dtype)) for t in self.program.tables}
            return self.tables.route_gradients(self.node.group.merge_table_grads(
                self.tables.take_table_gradients(), dims))

        outcome = self.node.step(step, position, lookup_error, table_grads, self._push_endpoints)
        self.tables.clear()
        self.model.zero_grad(set_to_none=True)
        if outcome is None:
            self.step_count, self.position = step + 1, position
        elif outcome == REPLAY:
            self.feed.rewound = True  # batches() trains the batch again, at the same step
        else:
            self._resynced(outcome)
            self.feed.rewound = True
        return self.step_count

    def _push_pull_all(self, step: int, grads: Dict[str, list],
                       push_pull: Callable[[str, list], int]) -> Optional[Decision]:
        """``push_pull(ep, grads[ep])`` on every pserver in parallel, healing what can heal."""
        return self.recovery.heal(step, f"step {step}", lambda: self.comm.run_parallel(
            {ep: (lambda ep=ep: push_pull(ep, grads[ep])) for ep in self._push_endpoints}), self._pull_all)

    def _resynced(self, outcome: Decision) -> None:
        """Go on from where the pservers are after a restart or a drop (their parameters are pulled)."""
        self.tables.clear()
        self.step_count = outcome.step
        if outcome.action == ROLLBACK:
            self.position = outcome.position
            self.feed.rewound = True  # batches() replays the data from the checkpoint's position

    def _send(self, step: int, grads: Dict[str, list], position: Position) -> None:
        """Push-pull ``step`` on every pserver; pulled blocks land in the staging buffers."""
        # Async only: recovery retries, never rolls back (see trainer.recovery.decide).
        self._push_pull_all(step, grads, lambda ep, g: self.comm.push_pull(
            ep, step, g, self.blocks.expect, self.blocks.stage, position))
        self.position = position

    def _finish_in_flight(self) -> None:
        """Wait for the step sent in the background; install the parameters it pulled."""
        if self._in_flight is None:
            return
        sent, self._in_flight = self._in_flight, None
        sent.result()  # re-raises the push's PserverError here, on the caller's thread
        self.blocks.install_staged()

    def pull(self) -> None:
        """Refresh the local parameters from the pservers now (async: latest; sync: current step).

        A pserver lost meanwhile is waited for and re-synced with, as in a step;
        in sync mode that may move this trainer to another step (a roll-back:
        :meth:`batches` then replays the data since the checkpoint).
        """
        self._check_open()
        self._finish_in_flight()
        step = self.step_count
        if self.node is not None:
            outcome = self.node.pull(step, step if self.sync_mode else 0)
        else:
            outcome = self.recovery.heal(step, f"pull at step {step}",
                                         lambda: self._pull_all(step if self.sync_mode else 0), self._pull_all)
        if outcome is not None:
            self._resynced(outcome)

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
        self._finish_in_flight()  # the saved rows include this trainer's last step

        def save() -> List[str]:
            replies = self.comm.run_parallel({ep: (lambda ep=ep: self.comm.save_tables(ep, directory))
                                              for ep in self.program.pservers})
            return [p for reply in replies.values() for p in reply.paths]
        return self.node.leader_does("save_tables", save) if self.node is not None else save()

    def batches(self, loader: Iterable, epochs: int,
                prefetch: Optional[Callable[[object], Dict[str, object]]] = None) -> Iterator:
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
        self._check_open()
        return self.feed.batches(loader, epochs, prefetch)

    def checkpoint(self) -> List[str]:
        """Every pserver writes its part of a checkpoint now; returns the part directories.

        Needs ``checkpoint_dir``. In sync mode, between two of this trainer's
        steps every pserver is at the same step, so the parts make one model.
        """
        self._check_open()
        self._finish_in_flight()

        def checkpoint() -> List[str]:
            replies = self.comm.run_parallel({ep: (lambda ep=ep: self.comm.checkpoint(ep))
                                              for ep in self.program.pservers})
            return [replies[ep].path for ep in self.program.pservers]
        return self.node.leader_does("checkpoint", checkpoint) if self.node is not None else checkpoint()

    def sampler(self, dataset: Dataset, **kwargs) -> DistributedSampler:
        """This process's shard of ``dataset``: a ``DistributedSampler`` over every process of every node.

        Keyword arguments go to ``DistributedSampler`` (``shuffle``, ``seed``,
        ``drop_last``); call ``set_epoch`` on it every epoch when shuffling.
        """
        return DistributedSampler(dataset, num_replicas=self.program.trainers * self.local_world_size,
                                  rank=self.trainer_id * self.local_world_size + self.local_rank, **kwargs)

    def close(self) -> None:
        """Tell every pserver this trainer is done and release connections. Idempotent.

        A pserver that died under the Close (or is down) gets it again once it
        is back, for up to ``connect_timeout`` s: restarted from a checkpoint
        older than this Close, it would wait for this trainer. Leaving a
        ``with`` block on an exception closes without waiting.
        """
        self._close(patient=True)

    def _close(self, patient: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if self._overlap is not None:
            self._overlap.remove()
        if self._heartbeat is not None:
            self._heartbeat.stop()
        try:
            self._finish_in_flight()  # the last step reaches the pservers before Close
            if self.node is not None and not self.node.group.failed:  # all local ranks done: the leader closes
                self.node.group.barrier(f"trainer node {self.trainer_id} closing")
        except BaseException:
            patient = False  # the job failed here: say so quickly, do not wait for pservers
            raise
        finally:
            self.feed.close()
            if self._sender is not None:
                self._sender.shutdown(wait=False)
            if self.node is None or (self.node.group.is_leader and not self.node.group.failed):
                self.comm.close(self.program.config.connect_timeout if patient else 0.0)
            else:  # a failed node does not Close: the pservers wait for it to restart and rejoin
                self.comm.shutdown()
            self._leave_group()
        log.info("trainer %d%s: closed after step %d (pushed %s bytes, pulled %s bytes)",
                 self.trainer_id, self._local, self.step_count, f"{self.comm.bytes_pushed:,}",
                 f"{self.comm.bytes_pulled:,}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"trainer {self.trainer_id} is closed")

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self._close(patient=exc_type is None)
