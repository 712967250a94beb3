"""Command-line flags for DistributeTranspilerConfig and transpile(), shared by the CLIs."""
from __future__ import annotations

import argparse
import dataclasses

from .config import NONFINITE_GRADS, SPLIT_METHODS, DistributeTranspilerConfig

CHOICES = {"split_method": SPLIT_METHODS, "nonfinite_grads": NONFINITE_GRADS}
# Fields that are None or an int: their flags parse ints.
INT_OR_NONE = ("max_staleness", "metrics_port", "health_port", "server_replicas", "replica_lease_ttl")


def _bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_transpile_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--sync_mode`` and one flag per DistributeTranspilerConfig field."""
    parser.add_argument("--sync_mode", type=_bool, default=True, metavar="BOOL",
                        help="true: synchronous updates (default); false: asynchronous")
    defaults = DistributeTranspilerConfig()
    for f in dataclasses.fields(DistributeTranspilerConfig):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            kind = _bool
        elif f.name in INT_OR_NONE:
            kind = int
        elif default is None:
            kind = str
        else:
            kind = type(default)
        parser.add_argument(f"--{f.name}", type=kind, default=default,
                            choices=CHOICES.get(f.name),
                            help=f"DistributeTranspilerConfig.{f.name} (default {default!r})")


def config_from_args(args: argparse.Namespace) -> DistributeTranspilerConfig:
    """Build the config from flags added by :func:`add_transpile_arguments`."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistributeTranspilerConfig)}
    return DistributeTranspilerConfig(**values)
