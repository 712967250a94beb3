"""DistributedEmbedding: the module that stands in for a distributed nn.Embedding / nn.EmbeddingBag."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from transpiler.tables import TableSpec

from ..errors import MOVED, PserverError
from .client import TableClient


def install_tables(
    model: torch.nn.Module,
    specs: Sequence[TableSpec],
    client: TableClient,
    device: Optional[torch.device] = None,
) -> None:
    """Put a :class:`DistributedEmbedding` in place of each distributed table's module of ``model``.

    Their outputs land on ``device`` (the trainer's), whatever device the ids come on.
    """
    for spec in specs:
        parent_name, _, attr = spec.name.rpartition(".")
        try:
            parent = model.get_submodule(parent_name)
            module = getattr(parent, attr)
        except AttributeError:
            raise ValueError(
                f"the model has no module {spec.name!r} named as a distributed table in the plan"
            ) from None
        if isinstance(module, DistributedEmbedding):
            raise ValueError(
                f"table {spec.name!r} of this model is already served by a Trainer; "
                f"build a fresh model for each Trainer"
            )
        if getattr(module, "embedding_dim", None) != spec.dim:
            raise ValueError(
                f"module {spec.name!r} is {type(module).__name__} of dim "
                f"{getattr(module, 'embedding_dim', None)}, the plan says a table of "
                f"dim {spec.dim}"
            )
        setattr(parent, attr, DistributedEmbedding(spec, client, device))


def serve_tables_from(model: torch.nn.Module, specs: Sequence[TableSpec], client: TableClient) -> None:
    """Have the :class:`DistributedEmbedding` modules :func:`install_tables` put in ``model`` fetch their rows
    through ``client`` (the trainer's table client of a new layout)."""
    for spec in specs:
        module = model.get_submodule(spec.name)
        if not isinstance(module, DistributedEmbedding):
            raise ValueError(f"table {spec.name!r} of this model is not served by a Trainer")
        module.serve_from(client)


class DistributedEmbedding(torch.nn.Module):
    """Stands in for a distributed ``nn.Embedding`` / ``nn.EmbeddingBag``: rows come from pservers.

    Called like the module it replaces: ``(ids)`` for an embedding (output
    ``ids.shape + (dim,)``), ``(ids, offsets=None, per_sample_weights=None)``
    for a bag (output ``(bags, dim)``). It holds no parameters. The output is
    on ``device`` (default: the ids' device); ids are best given on the CPU,
    where they are deduplicated and routed anyway.
    """

    def __init__(self, spec: TableSpec, client: TableClient, device: Optional[torch.device] = None):
        super().__init__()
        self.spec = spec
        self._client = client
        self._device = device

    def serve_from(self, client: TableClient) -> None:
        """Fetch rows through ``client`` from now on (the trainer changed layout)."""
        self._client = client

    def forward(
        self,
        input: torch.Tensor,
        offsets: Optional[torch.Tensor] = None,
        per_sample_weights: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        spec = self.spec
        if spec.kind == "embedding" and (offsets is not None or per_sample_weights is not None):
            raise TypeError(f"distributed table {spec.name!r} is an nn.Embedding: it takes no offsets")
        unique, inverse = self._client.dedupe(input)
        device = self._device or input.device
        try:
            rows = self._client.rows(spec.name, unique)
        except PserverError as e:
            if e.kind != MOVED:
                raise
            self._client.moved(e)  # the trainer adopts the layout the job runs now, serving this from there
            rows = self._client.rows(spec.name, unique)
        rows = rows.to(device)
        padding = None
        if spec.padding_idx is not None:
            at = np.flatnonzero(unique == spec.padding_idx)
            if at.size:
                padding = int(at[0])
                rows[padding] = 0
        if torch.is_grad_enabled():
            rows.requires_grad_(True)
            self._client.record(spec.name, unique, rows)
        index = torch.from_numpy(inverse).to(device).view(input.shape)
        if spec.kind == "embedding":
            return F.embedding(index, rows, padding_idx=padding)
        if offsets is not None:
            offsets = offsets.to(device)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device)
        return F.embedding_bag(
            index,
            rows,
            offsets,
            mode=spec.mode,
            per_sample_weights=per_sample_weights,
            include_last_offset=spec.include_last_offset,
            padding_idx=padding,
        )

    def extra_repr(self) -> str:
        kind = f"EmbeddingBag mode={self.spec.mode}" if self.spec.kind == "bag" else "Embedding"
        return f"{self.spec.name!r}, dim={self.spec.dim}, distributed {kind}"
