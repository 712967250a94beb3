"""A trainer node's local processes (one per GPU) acting as one trainer: the collectives among them.

The pservers see one trainer per node. Its gradient is the mean of the local
processes' gradients, reduced among them before anything goes on the wire:

1. every local process copies its block gradients into one flat buffer laid
   out by *owner*: pserver ``k`` belongs to local rank ``k % local_world_size``
   and so do its blocks; one ``reduce_scatter_tensor`` leaves each local rank
   with the node's summed gradients of its own blocks only (on gloo one
   ``all_reduce``, which is faster there: see :class:`NodeGroup`);
2. each local rank pushes its blocks (and the node's merged table rows owned
   by its pservers) and pulls them back: every pserver still gets exactly one
   push per node per step, so the pservers need no notion of local ranks;
3. one ``all_gather_into_tensor`` hands every local rank the fresh blocks of
   the others.

Each flat region ends with a status slot, so the same two collectives also
tell every local rank whether a lookup or a transfer failed anywhere in the
node: the node then heals as one (see :mod:`trainer.steppers.node`).

The collectives run on the node's process group: NCCL for CUDA tensors, gloo
for CPU ones, the same code. Transfers to pservers go through pinned host
buffers when the model is on a GPU.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from transpiler.plans import BlockSpec
from transpiler.tables import merge_duplicates

log = logging.getLogger(__name__)

# Status a local rank reports with its share: the node takes the worst.
OK, RECOVERABLE, FATAL = 0, 1, 2

# {table: (unique ids, gradient rows)}
TableGrads = Dict[str, Tuple[np.ndarray, torch.Tensor]]


class NodeError(RuntimeError):
    """A local process of this trainer node failed or left: the node stops as a whole."""


def owners(endpoints: Sequence[str], local_world_size: int) -> Dict[str, int]:
    """The local rank that pushes to and pulls from each pserver: ``index % local_world_size``.

    Dealing pservers round-robin spreads the traffic over
    ``min(#pservers, local_world_size)`` local ranks, and keeps one push per
    node per step on every pserver.
    """
    return {ep: k % local_world_size for k, ep in enumerate(endpoints)}


@dataclass(frozen=True)
class Slot:
    """Where block ``block`` sits in its owner's region of the flat buffers."""

    block: BlockSpec
    rank: int
    offset: int
    numel: int


class Layout:
    """The node's flat buffers: one region per local rank, holding the blocks of its pservers.

    A gradient region is ``[block data..., one has-gradient flag per block,
    status]``; a parameter region is ``[block data..., status]``. Regions are
    padded to the longest, as the collectives need equal parts.
    """

    def __init__(
        self,
        blocks_by_endpoint: Mapping[str, Sequence[BlockSpec]],
        endpoints: Sequence[str],
        local_world_size: int,
    ):
        dtypes = {b.dtype for bs in blocks_by_endpoint.values() for b in bs}
        if len(dtypes) > 1:
            raise ValueError(
                f"a trainer node with several local processes needs every dense parameter "
                f"of one dtype; the plan has {sorted(dtypes)}"
            )
        self.dtype = getattr(torch, dtypes.pop()) if dtypes else torch.float32
        self.owner = owners(endpoints, local_world_size)
        self.size = local_world_size
        self.slots: List[List[Slot]] = [[] for _ in range(local_world_size)]
        for ep in endpoints:
            rank = self.owner[ep]
            for b in blocks_by_endpoint.get(ep, []):
                region = self.slots[rank]
                offset = region[-1].offset + region[-1].numel if region else 0
                region.append(Slot(b, rank, offset, int(np.prod(b.shape))))
        data = [sum(s.numel for s in region) for region in self.slots]
        self.data_numel = data
        self.grad_chunk = max(d + len(r) for d, r in zip(data, self.slots)) + 1
        self.param_chunk = max(data) + 1

    def endpoints_of(self, rank: int) -> List[str]:
        """The pservers local rank ``rank`` talks to for the node."""
        return [ep for ep, r in self.owner.items() if r == rank]


class NodeGroup:
    """This local process's side of the node's collectives, over the node's process group.

    A local process that dies closes its connections, which fails the others'
    collectives at once (gloo), or within the process group's timeout (NCCL's watchdog).

    ``exchange`` picks the collectives: "scatter" (reduce-scatter the
    gradients, all-gather the parameters) or "all_reduce" (all-reduce the
    whole gradient buffer and keep one's own region; all-reduce a parameter
    buffer where every rank filled only its own region). None picks
    "scatter" for NCCL, whose ring all-reduce *is* a reduce-scatter plus an
    all-gather, so splitting it leaves each rank only its share; and
    "all_reduce" for gloo, whose reduce-scatter and all-gather take about
    twice an all-reduce of the same buffer (38 MB, 2 processes: 65 and
    55 ms against 30 ms). Both give the same numbers.
    """

    def __init__(
        self,
        node_id: int,
        local_rank: int,
        layout: Layout,
        device: torch.device,
        group: Optional[dist.ProcessGroup],
        exchange: Optional[str] = None,
    ):
        self.node_id = node_id
        self.rank = local_rank
        self.size = layout.size
        self.layout = layout
        self.device = device
        self.group = group
        self.is_leader = local_rank == 0
        # Set when a collective failed: the node is broken, and must not Close for the trainer id.
        self.failed = False
        if exchange is None:
            exchange = "scatter" if device.type == "cuda" else "all_reduce"
        if exchange not in ("scatter", "all_reduce"):
            raise ValueError(f"exchange must be 'scatter' or 'all_reduce', got {exchange!r}")
        self.exchange = exchange
        dt = layout.dtype
        self._grads = torch.zeros(self.size * layout.grad_chunk, dtype=dt, device=device)
        self._params = torch.zeros(self.size * layout.param_chunk, dtype=dt, device=device)
        if exchange == "scatter":
            self._my_grads = torch.zeros(layout.grad_chunk, dtype=dt, device=device)
        else:
            self._my_grads = self._grads[self.rank * layout.grad_chunk : (self.rank + 1) * layout.grad_chunk]
        self._my_params = self._params[self.rank * layout.param_chunk : (self.rank + 1) * layout.param_chunk]
        if device.type == "cuda":  # transfers to and from pservers stage in pinned host memory
            self._host_grads = torch.zeros(layout.grad_chunk, dtype=dt, pin_memory=True)
            self._host_params = torch.zeros(layout.param_chunk, dtype=dt, pin_memory=True)
        else:
            self._host_grads, self._host_params = self._my_grads, self._my_params
        self._mine = {s.block.name: s for s in layout.slots[self.rank]}

    @property
    def endpoints(self) -> List[str]:
        """The pservers this local rank pushes to and pulls from."""
        return self.layout.endpoints_of(self.rank)

    def _run(self, what: str, collective: Callable[[], object]):
        try:
            return collective()
        except RuntimeError as e:  # torch raises DistBackendError (a RuntimeError) when a peer is gone
            self.failed = True
            raise NodeError(
                f"trainer node {self.node_id}, local rank {self.rank}: {what} failed ({e}); a "
                f"local process of the node stopped or died. The node stops as a whole: restart "
                f"all its processes and it rejoins as trainer {self.node_id}"
            ) from None

    # -- gradients ------------------------------------------------------------

    def reduce_grads(
        self, grad_of: Callable[[BlockSpec], Optional[torch.Tensor]], failed: bool
    ) -> Tuple[List[Tuple[str, torch.Tensor]], bool]:
        """Reduce-scatter the node's block gradients; (this rank's mean blocks to push, any failed).

        ``grad_of(block)`` is this process's gradient rows of a block, or None.
        A block is pushed when any local process had a gradient for it (the
        others count as zero, as rows of a concatenated batch would).
        ``failed`` (a lookup of this process's batch failed) comes back
        or-ed over the node; the gradients then mean nothing.
        """
        layout, flat, chunk = self.layout, self._grads, self.layout.grad_chunk
        with torch.no_grad():
            flat.zero_()
            for rank, region in enumerate(layout.slots):
                base = rank * chunk
                flags = base + layout.data_numel[rank]
                for i, s in enumerate(region):
                    g = grad_of(s.block)
                    if g is not None:
                        flat[base + s.offset : base + s.offset + s.numel].copy_(g.reshape(-1))
                        flat[flags + i] = 1
                flat[base + chunk - 1] = float(failed)
            if self.group is None:
                self._my_grads.copy_(flat)
            elif self.exchange == "scatter":
                self._run(
                    "the node's gradient reduce-scatter",
                    lambda: dist.reduce_scatter_tensor(self._my_grads, flat, group=self.group),
                )
            else:  # _my_grads is this rank's region of flat
                self._run("the node's gradient all-reduce", lambda: dist.all_reduce(flat, group=self.group))
            if self._my_grads[-1].item() > 0:
                return [], True
            mine = layout.slots[self.rank]
            self._my_grads[: layout.data_numel[self.rank]].div_(self.size)
            if self._host_grads is not self._my_grads:
                self._host_grads.copy_(self._my_grads, non_blocking=True)
                torch.cuda.current_stream(self.device).synchronize()
            flags = self._host_grads[layout.data_numel[self.rank] : layout.data_numel[self.rank] + len(mine)]
            pushed = flags.nonzero().flatten().tolist()
            return [
                (
                    mine[i].block.name,
                    self._host_grads[mine[i].offset : mine[i].offset + mine[i].numel].view(
                        mine[i].block.shape
                    ),
                )
                for i in pushed
            ], False

    def merge_table_grads(
        self, local: TableGrads, tables: Mapping[str, Tuple[int, torch.dtype]]
    ) -> TableGrads:
        """The node's mean table gradients: every process's rows, ids merged across the node.

        ``tables`` maps every table to its (row width, dtype); all processes
        list the same. A table comes back when some process had a gradient for it.
        """
        names = sorted(tables)
        counts = torch.tensor([len(local[t][0]) if t in local else -1 for t in names], dtype=torch.int64)
        every = self._all_gather(counts, "the node's table gradient sizes")
        merged: TableGrads = {}
        for i, name in enumerate(names):
            sizes = every[:, i].tolist()
            if max(sizes) < 0:
                continue
            longest, (dim, dtype) = max(max(sizes), 1), tables[name]
            ids = torch.zeros(longest, dtype=torch.int64)
            rows = torch.zeros((longest, dim), dtype=dtype)
            if sizes[self.rank] > 0:
                ids[: sizes[self.rank]] = torch.from_numpy(local[name][0])
                rows[: sizes[self.rank]] = local[name][1]
            all_ids = self._all_gather(ids, f"the node's ids of table {name!r}")
            all_rows = self._all_gather(rows, f"the node's gradient rows of table {name!r}")
            keep = [slice(0, max(n, 0)) for n in sizes]
            node_ids = np.concatenate([all_ids[r, k].numpy() for r, k in enumerate(keep)])
            node_rows = torch.cat([all_rows[r, k] for r, k in enumerate(keep)])
            node_ids, node_rows = merge_duplicates(node_ids, node_rows)
            merged[name] = (node_ids, node_rows / self.size)
        return merged

    def _all_gather(self, t: torch.Tensor, what: str) -> torch.Tensor:
        """``t`` of every local rank, stacked on a new first dimension, on the CPU."""
        if self.group is None:
            return t.unsqueeze(0)
        src = t.to(self.device)
        out = torch.empty((self.size * t.shape[0],) + tuple(t.shape[1:]), dtype=t.dtype, device=self.device)
        self._run(what, lambda: dist.all_gather_into_tensor(out, src, group=self.group))
        return out.view((self.size,) + tuple(t.shape)).cpu()

    # -- parameters -----------------------------------------------------------

    def param_dest(self, name: str) -> torch.Tensor:
        """Where a pulled block of this rank lands (host memory), for :meth:`gather_params`."""
        s = self._mine[name]
        return self._host_params[s.offset : s.offset + s.numel].view(s.block.shape)

    def gather_params(self, status: int, view_of: Callable[[BlockSpec], torch.Tensor]) -> int:
        """All-gather every rank's pulled blocks into the model; returns the node's worst status.

        Nothing is installed unless every rank's pull went through (status OK).
        """
        chunk = self.layout.param_chunk
        with torch.no_grad():
            self._host_params[-1] = status
            if self._host_params is not self._my_params:
                self._my_params.copy_(self._host_params, non_blocking=True)
            if self.group is not None and self.exchange == "scatter":
                mine = self._my_params.clone()  # all_gather_into_tensor wants its input apart from the output
                self._run(
                    "the node's parameter all-gather",
                    lambda: dist.all_gather_into_tensor(self._params, mine, group=self.group),
                )
            elif self.group is not None:  # the other regions are zero here: the sum is a gather
                self._run(
                    "the node's parameter all-reduce", lambda: dist.all_reduce(self._params, group=self.group)
                )
            worst = int(self._params[chunk - 1 :: chunk].max().item())
            if worst == OK:
                self._install(view_of)
            self._zero_others()
            return worst

    def _zero_others(self) -> None:
        """All-reduce exchange: only this rank's region may be non-zero before the next gather."""
        if self.exchange == "all_reduce":
            chunk = self.layout.param_chunk
            self._params[: self.rank * chunk].zero_()
            self._params[(self.rank + 1) * chunk :].zero_()

    def _install(self, view_of: Callable[[BlockSpec], torch.Tensor]) -> None:
        chunk = self.layout.param_chunk
        for rank, region in enumerate(self.layout.slots):
            base = rank * chunk
            for s in region:
                view_of(s.block).copy_(
                    self._params[base + s.offset : base + s.offset + s.numel].view(s.block.shape)
                )

    def broadcast_params(self, view_of: Callable[[BlockSpec], torch.Tensor]) -> None:
        """Every block from the leader (local rank 0) to every local rank: after a join or a re-sync."""
        chunk = self.layout.param_chunk
        with torch.no_grad():
            if self.is_leader:
                for rank, region in enumerate(self.layout.slots):
                    for s in region:
                        start = rank * chunk + s.offset
                        self._params[start : start + s.numel].copy_(view_of(s.block).reshape(-1))
            if self.group is not None:
                self._run(
                    "the node's parameter broadcast",
                    lambda: dist.broadcast(self._params, 0, group=self.group),
                )
            if not self.is_leader:
                self._install(view_of)
            self._zero_others()

    def broadcast(self, obj):
        """``obj`` of the leader, on every local rank (small Python objects: decisions, sessions)."""
        if self.group is None:
            return obj
        box = [obj]
        self._run(
            "the node's broadcast from local rank 0",
            lambda: dist.broadcast_object_list(box, 0, group=self.group, device=self._object_device()),
        )
        return box[0]

    def all_gather(self, obj, what: str) -> list:
        """Every local rank's ``obj`` (small Python objects), in local rank order, on every rank."""
        if self.group is None:
            return [obj]
        out = [None] * self.size
        self._run(what, lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def barrier(self, what: str) -> None:
        """Wait for every local rank (``what`` names the point in errors)."""
        if self.group is not None:
            self._run(what, lambda: dist.barrier(group=self.group))

    def _object_device(self) -> Optional[torch.device]:
        return self.device if self.device.type == "cuda" else None
