"""Counters: what a pserver's servicer has received, sent and refused, since it started.

Read by the Stats RPC (``ps-stat``) and by the Prometheus collector at scrape
time; written on the request path under one small lock of their own (never
the engine's).
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Tuple

import grpc

from psproto import ps_pb2
from transpiler.layout.routing import ROUTING_VERSION

from ..layout.phases import LayoutStatus


class Counters:
    """Traffic and refusals of one pserver's servicer, for Stats and the Prometheus metrics."""

    def __init__(self):
        self.lock = threading.Lock()
        self.bytes_in = 0
        self.bytes_out = 0
        self.pushes = 0
        self.shared_pushes = 0  # of which through shared memory
        self.prefetches = 0
        self.refused = 0
        self.dropped_pushes = 0  # backup trainers: pushes of trainers dropped from their step
        # Heartbeats received: trainers send them only towards pservers they were silent to for an interval.
        self.heartbeats = 0
        # Refusals by (reason, status): the refusal's class name ("internal" for a bug) and its gRPC code.
        self.refused_by: Dict[Tuple[str, str], int] = {}
        # Per trainer (a node counts once): pushes counted and block gradients in them.
        self.pushes_by_trainer: Dict[int, int] = {}
        self.blocks_by_trainer: Dict[int, int] = {}
        self.heartbeats_by_trainer: Dict[int, int] = {}

    def counted(self, trainer_id: int, blocks: int) -> None:
        """Count one applied push of ``trainer_id`` carrying ``blocks`` block gradients."""
        with self.lock:
            self.pushes_by_trainer[trainer_id] = self.pushes_by_trainer.get(trainer_id, 0) + 1
            self.blocks_by_trainer[trainer_id] = self.blocks_by_trainer.get(trainer_id, 0) + blocks

    def heartbeat(self, trainer_id: int) -> None:
        """Count one heartbeat of ``trainer_id`` (a node counts once)."""
        with self.lock:
            self.heartbeats += 1
            self.heartbeats_by_trainer[trainer_id] = self.heartbeats_by_trainer.get(trainer_id, 0) + 1

    def add(
        self, bytes_in=0, bytes_out=0, pushes=0, prefetches=0, refused=0, shared_pushes=0, dropped_pushes=0
    ):
        """Add to the traffic counters."""
        with self.lock:
            self.dropped_pushes += dropped_pushes
            self.bytes_in += bytes_in
            self.bytes_out += bytes_out
            self.pushes += pushes
            self.shared_pushes += shared_pushes
            self.prefetches += prefetches
            self.refused += refused

    def refuse(self, reason: str, code: grpc.StatusCode) -> None:
        """Count one refused request, by its reason and status."""
        with self.lock:
            self.refused += 1
            key = (reason, code.name)
            self.refused_by[key] = self.refused_by.get(key, 0) + 1

    def stats_reply(
        self,
        endpoint: str,
        snap,
        incarnation: int,
        uptime_s: float,
        replica,
        layout_epoch: int = 0,
        layout: LayoutStatus = LayoutStatus(),
    ) -> ps_pb2.StatsReply:
        """The Stats answer: these counters beside the engine's snapshot ``snap``, the replica's stats
        (or None), the layout epoch served and the job's change of layout (``layout``, a LayoutStatus)."""
        last = snap.checkpoint
        with self.lock:
            return ps_pb2.StatsReply(
                endpoint=endpoint,
                step=snap.step,
                trainers_alive=snap.alive,
                blocks=snap.blocks,
                block_bytes=snap.block_bytes,
                bytes_in=self.bytes_in,
                bytes_out=self.bytes_out,
                pushes=self.pushes,
                sync_mode=snap.sync_mode,
                table_rows=snap.table_rows,
                table_bytes=snap.table_bytes,
                prefetches=self.prefetches,
                incarnation=incarnation,
                uptime_s=uptime_s,
                trainers_dropped=snap.dropped,
                refused=self.refused,
                shared_pushes=self.shared_pushes,
                heartbeats=self.heartbeats,
                dropped_pushes=self.dropped_pushes,
                checkpoint_step=last.step if last else -1,
                checkpoint_path=last.path if last else "",
                checkpoint_age_s=time.time() - last.time if last else 0.0,
                tables=[ps_pb2.TableStats(**t.to_dict()) for t in snap.tables],
                replica=replica,
                layout_epoch=layout_epoch,
                routing_version=ROUTING_VERSION,
                layout_change=layout.change,
                layout_parts_moved=layout.moved,
                layout_parts_to_move=layout.to_move,
                layout_change_s=layout.last_change_s,
            )
