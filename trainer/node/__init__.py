"""Trainer nodes: several local processes (one per GPU) that train as one trainer.

- :mod:`~trainer.node.devices`: which device a process computes on, the process group it joins;
- :mod:`~trainer.node.rendezvous`: where the node's processes meet (their own address, or a job-wide
  store under the node's prefix), decided from the environment;
- :mod:`~trainer.node.group`: the node's flat buffers and collectives (reduce-scatter, all-gather,
  the merge of table gradients), with the status slots that make a failure node-wide;

How the node joins, steps, pulls and re-syncs as one trainer is its stepper's
(:mod:`trainer.steppers.node`).
"""

from .devices import backend_for, join_group, pick_device
from .group import FATAL, OK, RECOVERABLE, Layout, NodeError, NodeGroup, owners
from .rendezvous import NodeRendezvous, SharedStore, node_rendezvous

__all__ = [
    "pick_device",
    "backend_for",
    "join_group",
    "node_rendezvous",
    "NodeRendezvous",
    "SharedStore",
    "Layout",
    "NodeGroup",
    "NodeError",
    "owners",
    "OK",
    "RECOVERABLE",
    "FATAL",
]
