"""A trainer's transport: the only part of the trainer that speaks gRPC and reads status codes.

- ``channels.py``: :class:`Channels`, a channel per pserver and the threads their calls run on;
- ``channel.py``: :class:`PserverChannel`, every call to one pserver: its session's Hello and
  Close and the control calls made there, the rest by its parts (the next four);
- ``shard_link.py``: the process of the pserver's shard its calls go to, and their session;
- ``primaries.py``: following a shard's primary under hot standby;
- ``tensor_calls.py``: push-pull, pull and prefetch, and their answers read into tensors;
- ``lanes.py``: a large push-pull split across several connections;
- ``connection.py``: the gRPC calls over one channel to one process;
- ``wire_paths.py``: the ways a push-pull or a prefetch goes (shared memory, one message, a
  stream, streamed during backward) and the rule that picks one;
- ``narrowing.py``: gradients cast to the wire dtype; ``shared_regions.py``: a trainer's
  shared-memory regions; ``status_codes.py``: the one mapping of status codes to
  :mod:`trainer.errors`' kinds; ``contact.py``: when a pserver last heard from this trainer.
"""

from .channel import PserverChannel
from .channels import Channels, results_of
from .data.started import StartedPush, answered_first
from .status_codes import kind_of
from .wire_paths import DecodeInto, DtypeAndShape, Named, NamedTensors, TensorsByPserver

__all__ = [
    "Channels",
    "PserverChannel",
    "kind_of",
    "results_of",
    "StartedPush",
    "answered_first",
    "DecodeInto",
    "DtypeAndShape",
    "Named",
    "NamedTensors",
    "TensorsByPserver",
]
