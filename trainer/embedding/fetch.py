"""Row fetches through the communicator: one prefetch round trip per pserver, or zero rows for a spoilt batch."""
from __future__ import annotations

from typing import Dict

import torch

from ..errors import PserverError
from .client import Pieces, TableClient, asked_rows


def prefetch_all(comm, tables: TableClient, pieces: Pieces, min_updates: int) -> Dict[str, Dict[str, torch.Tensor]]:
    """One prefetch round trip per pserver in ``pieces`` through ``comm``, in parallel: {pserver: {name: rows}}."""
    def fetch_one(ep):
        expected = asked_rows(tables, pieces[ep])
        rows = comm.prefetch(ep, min_updates, pieces[ep], expected.get)
        if rows.keys() != expected.keys():
            raise PserverError(ep, f"prefetch answer holds {sorted(rows)}, asked for {sorted(expected)}")
        return rows
    return comm.run_parallel({ep: (lambda ep=ep: fetch_one(ep)) for ep in pieces})


def zero_rows(tables: TableClient, pieces: Pieces) -> Dict[str, Dict[str, torch.Tensor]]:
    """Zero rows in the shape of ``pieces``' prefetch answers: what a spoilt batch computes with."""
    return {ep: {name: torch.zeros(shape, dtype=getattr(torch, dtype))
                 for name, (dtype, shape) in asked_rows(tables, asked).items()}
            for ep, asked in pieces.items()}
