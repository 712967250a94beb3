"""Dtype names: the one table of every dtype a plan names or a tensor travels as.

Plans, the wire (``TensorPiece.dtype``) and table files all name a dtype by
torch's name without ``torch.`` ("float32"); this module is where a name
becomes a dtype and back. Dense parameters may be any floating dtype here;
distributed tables only :data:`TABLE_DTYPES` (their rows live in numpy).
"""

from __future__ import annotations

import torch

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
}
TABLE_DTYPES = ("float32", "float64")


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name plans and the wire use."""
    return str(dtype).replace("torch.", "")
