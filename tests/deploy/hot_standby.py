"""What both hot-standby recipe checks share: the recipes' paths and sizes, and the roles a process finds.

tests/deploy/test_hot_standby_kubernetes.py checks deploy/kubernetes/hot-standby/,
tests/deploy/test_hot_standby_slurm.py deploy/slurm/train-hot-standby.sbatch; both give every
process's environment to RoleEnv and resolve_replicas, and transpile for the shards it serves.
"""

from __future__ import annotations

import socket
from typing import Dict, List

from torch import nn

from tests.helpers import paths
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program, RoleEnv
from transpiler.roles.replicas import resolve_replicas

ROOT = paths.REPO
HOT_STANDBY = ROOT / "deploy" / "kubernetes" / "hot-standby"
SBATCH = ROOT / "deploy" / "slurm" / "train-hot-standby.sbatch"
N = 2  # pservers (PS_PSERVER_NUM) in both recipes
COORDINATOR = "http://ps-etcd:2379"
PSERVERS = [f"ps-pserver-{i}.ps-pserver:6170" for i in range(N)]
REPLICAS = [f"ps-pserver-{N + i}.ps-pserver:6170" for i in range(N)]


def small_program() -> Program:
    # Big enough for blocks on both pservers (min_block_size is 8192 elements).
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))
    return Program(model, "sgd", lr=0.1)


def resolved(env: Dict[str, str], pservers: List[str]) -> DistributeTranspilerConfig:
    return resolve_replicas(DistributeTranspilerConfig(), pservers, env)


def shards(
    config: DistributeTranspilerConfig, role: RoleEnv, endpoints: List[str], monkeypatch
) -> Dict[str, tuple]:
    """Each endpoint's shard and block names, from a transpile with ``config`` (resolved from the pod's
    env)."""
    for var in ("PS_SERVER_REPLICAS", "PS_REPLICA_ENDPOINTS", "PS_COORDINATOR", "PS_COORDINATOR_PREFIX"):
        monkeypatch.delenv(var, raising=False)  # transpile reads os.environ for fields left None
    t = DistributeTranspiler(config)
    t.transpile(0, program=small_program(), pservers=role.pservers, trainers=role.trainers)
    programs = {ep: t.get_pserver_program(ep) for ep in endpoints}
    return {ep: (p.shard, tuple(b.name for b in p.blocks)) for ep, p in programs.items()}


def free_port_pair() -> int:
    """A port p with p and p + 1 free on 127.0.0.1 (etcd's client and peer ports)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port >= 65535:
            continue
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no two adjacent free ports")
