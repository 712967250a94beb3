"""Role: one process of a ps-launch job (a pserver, or a trainer node's local rank), and its environment.

What the launcher plans (:mod:`.plan`), starts (:mod:`.procs`), shows (:mod:`.console`) and supervises
(:mod:`.supervisor`) is a list of roles; :func:`child_env` is the environment a role's process starts
with: the launcher's own, less any role it runs in, plus the role's variables.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from transpiler.roles.role_env import NODE_VARS, PSERVER, ROLE_VARS


@dataclass
class Role:
    """One process of the job: its kind, global index, host and role variables; ``proc`` once started."""

    kind: str
    index: int
    host: str
    env: Dict[str, str]
    endpoint: Optional[str] = None
    log_path: Optional[str] = None
    proc: Optional[subprocess.Popen] = field(default=None, repr=False)
    local_rank: int = 0
    local_world_size: int = 1
    command: Optional[List[str]] = None  # what started it (and starts it again on a restart)
    restarts: int = 0  # restarts of its unit (a trainer node restarts as a whole)
    replica: int = 0  # hot standby: 1 for a pserver's second process

    def started(self, proc: subprocess.Popen) -> None:
        """The role runs as ``proc`` now (its first start, or a restart)."""
        self.proc = proc

    @property
    def name(self) -> str:
        """``pserver.N``, ``trainer.N`` or (a node of several processes) ``trainer.N.R``."""
        if self.local_world_size > 1:
            return f"{self.kind.lower()}.{self.index}.{self.local_rank}"
        return f"{self.kind.lower()}.{self.index}" + (".replica" if self.replica else "")

    @property
    def title(self) -> str:
        """How failure messages name the process: ``trainer node N local rank R (pid P)`` or its name."""
        if self.local_world_size > 1:
            pid = f" (pid {self.proc.pid})" if self.proc is not None else ""
            return f"trainer node {self.index} local rank {self.local_rank}{pid}"
        return self.name

    @property
    def log_name(self) -> str:
        """``serverlog.N``, ``workerlog.N`` (local rank 0) or ``workerlog.N.R`` (local rank R > 0)."""
        if self.kind == PSERVER:
            return f"serverlog.{self.index}" + (".replica" if self.replica else "")
        return f"workerlog.{self.index}" + (f".{self.local_rank}" if self.local_rank else "")

    @property
    def tag(self) -> str:
        """The console prefix and ``--show`` name: ``pserverN``, ``trainerN``, ``trainerN.R`` (local rank R
        > 0)."""
        return (
            f"{self.kind.lower()}{self.index}"
            + (f".{self.local_rank}" if self.local_rank else "")
            + (".replica" if self.replica else "")
        )

    @property
    def unit(self) -> Tuple[str, int, int]:
        """What stops and restarts together: a pserver process, or a trainer node with all its local ranks."""
        return self.kind, self.index, self.replica

    @property
    def alive(self) -> bool:
        """Started and not yet exited (polling reaps an exited process)."""
        return self.proc is not None and self.proc.poll() is None


# An outer torchrun's variables: with TORCHELASTIC_USE_AGENT_STORE inherited, torch's tcp:// rendezvous
# would make a node's local rank 0 a client of a store nobody hosts here.
_LAUNCHER_PREFIXES = ("TORCHELASTIC_", "GROUP_", "ROLE_")


def child_env(role: Role, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of ``role``'s process: ``base`` (default os.environ) plus its role variables.

    Role and node variables inherited from ``base`` are dropped first, so a launcher
    run inside another job (or under torchrun) cannot leak, say, a PADDLE_TRAINER_ID
    into a pserver, a LOCAL_RANK into a trainer, or torchrun's own variables into a node.
    """
    dropped = set(ROLE_VARS) | set(NODE_VARS)
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if k not in dropped and not k.startswith(_LAUNCHER_PREFIXES)
    }
    env.update(role.env)
    env["PYTHONUNBUFFERED"] = "1"
    return env
