"""Distributed embedding on the trainer: dedupe ids, route them, prefetch rows, push sparse gradients.

The trainer replaces every distributed ``nn.Embedding`` / ``nn.EmbeddingBag``
of the model with a :class:`DistributedEmbedding`. A lookup

1. dedupes the batch's ids (``np.unique``),
2. takes their rows from this step's prefetch cache, fetching any others
   from the pservers (each id from the pserver :mod:`transpiler.layout.routing` names,
   one round trip per pserver, all pservers in parallel),
3. makes the unique rows a leaf tensor and runs torch's own
   ``F.embedding`` / ``F.embedding_bag`` on it, so autograd merges the
   gradients of duplicate ids into one row per id.

At :meth:`TableClient.take_gradients` the leaves' gradients become, per
pserver, the ``"<table>@ids"`` / ``"<table>@rows"`` tensors of the push.
In GEO mode the rows live on the trainer between syncs instead
(:class:`TouchedRows`): lookups read them there, each step trains them, and
a sync pushes how far they moved.
"""

from .client import Fetch, NextBatchPlan, RowFetch, RowsByPserver, RowShapes, TableClient
from .module import DistributedEmbedding, install_tables, serve_tables_from
from .touched import TouchedRows

__all__ = [
    "TableClient",
    "TouchedRows",
    "NextBatchPlan",
    "RowFetch",
    "RowsByPserver",
    "RowShapes",
    "Fetch",
    "DistributedEmbedding",
    "install_tables",
    "serve_tables_from",
]
