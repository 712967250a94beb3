"""DistributeTranspiler: split a Program into pserver and trainer programs."""

from __future__ import annotations

import logging
import os
from typing import Dict, List, Optional, Sequence, Union

import torch

from psproto.dtypes import dtype_name

from .config import DistributeTranspilerConfig
from .layout.dense_blocks import layout_digest, place_params
from .plans import PserverProgram, StartupProgram, TrainerProgram
from .program import Program
from .roles.common import parse_endpoints
from .roles.replicas import replica_endpoints, resolve_replicas

log = logging.getLogger(__name__)


def _collective_endpoints(program: Program, pservers, sync_mode: bool) -> List[str]:
    """Check a collective-mode transpile's arguments; its pserver list is always empty."""
    if program.tables:
        raise ValueError(
            f"distributed tables {program.distributed_tables} need pservers: collective mode "
            f"keeps every parameter on every trainer; use mode='pserver'"
        )
    if not sync_mode:
        raise ValueError(
            "collective mode is synchronous (every step all-reduces the gradients of all "
            "trainers); use sync_mode=True, or mode='pserver' for asynchronous training"
        )
    if pservers:
        log.info("collective mode: ignoring pservers %s (no pserver is contacted)", pservers)
    return []


def _check_backups(sync_mode: bool, trainers: int, config: DistributeTranspilerConfig) -> None:
    """Backup trainers need a sync job with more trainers than backups."""
    backups = config.backup_trainers
    if backups and not sync_mode:
        raise ValueError(
            f"backup_trainers={backups} drops the slowest trainers of a sync step; async trainers "
            f"never wait for each other: use sync_mode=True, or backup_trainers=0"
        )
    if backups >= trainers:
        raise ValueError(
            f"backup_trainers={backups} leaves no trainer to make a step: it must be below the number "
            f"of trainers ({trainers})"
        )


def _check_geo(program: Program, sync_mode: bool, k_steps: int) -> None:
    """GEO mode (``k_steps`` > 0) is asynchronous, and its tables train with sgd: refuse what it cannot
    train."""
    if not k_steps:
        return
    if sync_mode:
        raise ValueError(
            f"k_steps={k_steps} is GEO mode, which is asynchronous (every trainer syncs on its own "
            f"every k_steps); use sync_mode=False, or k_steps=0 for synchronous training"
        )
    stateful = sorted(t.name for t in program.tables if t.optimizer.name != "sgd")
    if stateful:
        raise ValueError(
            f"GEO mode (k_steps={k_steps}) trains distributed tables with sgd (as Paddle's GEO-SGD): "
            f"a trainer keeps only the rows it touched since its last sync, so per-row optimizer "
            f"state could not last; tables {stateful} use another optimizer: give them "
            f"TableOptions(optimizer='sgd')"
        )


class DistributeTranspiler:
    """Splits a single-machine :class:`Program` into pserver and trainer programs.

    Call :meth:`transpile` once, then ask for the program of each role. Every
    role runs the same transpile on the same program and gets the same layout.
    """

    def __init__(self, config: Optional[DistributeTranspilerConfig] = None):
        self.config = config if config is not None else DistributeTranspilerConfig()
        self._program: Optional[Program] = None

    def transpile(
        self,
        trainer_id: int,
        program: Optional[Program] = None,
        pservers: Union[str, Sequence[str]] = "127.0.0.1:6174",
        trainers: int = 1,
        sync_mode: bool = True,
        startup_program=None,
        current_endpoint: Optional[str] = None,
    ) -> None:
        """Slice the program's parameters into blocks and place them on ``pservers``.

        ``trainer_id`` is this process's trainer index in ``[0, trainers)``
        (any valid value on a pserver). ``startup_program`` and
        ``current_endpoint`` are accepted for Paddle compatibility and unused.

        In collective mode (``config.mode="collective"``) there are no
        pservers: ``pservers`` may be empty or None (given ones are ignored),
        ``trainers`` counts trainer nodes, the job must be synchronous and the
        program must have no distributed tables.
        """
        if not isinstance(program, Program):
            raise TypeError("transpile needs program=Program(model, ...)")
        if not isinstance(trainers, int) or isinstance(trainers, bool) or trainers < 1:
            raise ValueError(f"trainers must be an int >= 1, got {trainers!r}")
        if not isinstance(trainer_id, int) or not 0 <= trainer_id < trainers:
            raise ValueError(f"trainer_id {trainer_id!r} is out of range [0, {trainers})")
        self.config.validate()
        if self.config.collective:
            endpoints = _collective_endpoints(program, pservers, sync_mode)
        else:
            endpoints = parse_endpoints(pservers)
            self.config = resolve_replicas(self.config, endpoints, os.environ)
            _check_geo(program, sync_mode, self.config.k_steps)
            _check_backups(sync_mode, trainers, self.config)
        shapes = [(name, list(p.shape), dtype_name(p.dtype)) for name, p in program.dense_parameters()]
        params = place_params(shapes, endpoints, self.config)

        self._program = program
        self._trainer_id = trainer_id
        self._endpoints = endpoints
        self._trainers = trainers
        self._sync_mode = bool(sync_mode)
        self._params = params
        self._digest = layout_digest(
            params, trainers, self._sync_mode, program.optimizer, program.tables, self.config
        )

    def _require_transpiled(self) -> None:
        if self._program is None:
            raise RuntimeError("call transpile() first")

    def _check_endpoint(self, endpoint: str) -> None:
        self._require_transpiled()
        if self.config.collective:
            raise ValueError(
                f"there is no pserver program for {endpoint!r}: the config is in collective "
                f"mode (mode={self.config.mode!r}), which trains with no pservers; use "
                f"mode='pserver' to train through pservers"
            )
        if endpoint not in self._endpoints and self._shard_endpoint(endpoint) is None:
            raise ValueError(
                f"{endpoint!r} is not one of the pservers {self._endpoints}"
                + (
                    f" or their replicas {self.config.replica_endpoints}"
                    if self.config.replica_endpoints
                    else ""
                )
            )

    def _shard_endpoint(self, endpoint: str):
        """The pserver whose shard ``endpoint`` serves (itself, or the one it replicates); None: neither."""
        for group in replica_endpoints(self.config, self._endpoints):
            if endpoint in group:
                return group[0]
        return None

    def get_pserver_program(self, endpoint: str) -> PserverProgram:
        """The plan of the pserver at ``endpoint``: its blocks and update rule.

        With ``server_replicas=2`` the endpoint may be a replica's: it serves the
        same blocks and table shard as the pserver it replicates.
        """
        self._check_endpoint(endpoint)
        owner = self._shard_endpoint(endpoint)
        blocks = [b for p in self._params for b in p.blocks if b.endpoint == owner]
        return PserverProgram(
            endpoint,
            list(self._endpoints),
            self._trainers,
            self._sync_mode,
            self._program.optimizer,
            blocks,
            self.config,
            self._digest,
            tables=list(self._program.tables),
            params=self._params,
        )

    def get_startup_program(
        self, endpoint: str, pserver_program: Optional[PserverProgram] = None
    ) -> StartupProgram:
        """Initial values of the blocks at ``endpoint``, cut from this process's model."""
        self._check_endpoint(endpoint)
        if pserver_program is not None and pserver_program.endpoint != endpoint:
            raise ValueError(f"pserver_program is for {pserver_program.endpoint}, not {endpoint}")
        values: Dict[str, torch.Tensor] = {}
        named = dict(self._program.dense_parameters())
        for p in self._params:
            data = named[p.name].detach()
            rows = data.reshape(p.shape[0] if p.shape else 1, -1)
            for b in p.blocks:
                if b.endpoint == self._shard_endpoint(endpoint):
                    values[b.name] = rows[b.row_start : b.row_end].reshape(b.shape).clone()
        return StartupProgram(endpoint, values)

    def get_trainer_program(self) -> TrainerProgram:
        """The whole layout for this trainer, carrying its model.

        In collective mode it lists no pservers and no blocks; its
        ``collective`` property is True and ``trainer.Trainer`` trains it with DDP.
        """
        self._require_transpiled()
        return TrainerProgram(
            self._trainer_id,
            list(self._endpoints),
            self._trainers,
            self._sync_mode,
            self._program.optimizer,
            self._params,
            self.config,
            self._digest,
            tables=list(self._program.tables),
            model=self._program.model,
        )
