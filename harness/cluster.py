"""In-process clusters for tests and the GPU check: real gRPC pservers on loopback, trainers in threads.

Every role runs its own transpile of a fresh program from the same builder,
exactly as separate processes would; only the process boundary is missing.
"""

from __future__ import annotations

import threading
from contextlib import ExitStack
from typing import Callable, Dict, List, Optional

from harness.ports import free_ports
from pserver import ParameterServer
from psproto.security import Security
from trainer import Trainer
from transpiler import DistributeTranspiler, DistributeTranspilerConfig, Program


class LocalCluster:
    """``n_pservers`` pservers started in this process; trainers made on demand.

    Use as a context manager; every pserver is stopped on exit. ``security``
    applies to pservers and trainers alike; None means none (no token, no TLS),
    never the process environment, so a developer's PS_AUTH_TOKEN cannot leak in.
    """

    def __init__(
        self,
        build: Callable[[], Program],
        n_pservers: int,
        n_trainers: int,
        sync_mode: bool = True,
        config: Optional[DistributeTranspilerConfig] = None,
        tables_from: Optional[str] = None,
        security: Optional[Security] = None,
    ):
        self.build = build
        self.security = security if security is not None else Security()
        self.tables_from = tables_from
        self.n_trainers = n_trainers
        self.sync_mode = sync_mode
        self.config = config or DistributeTranspilerConfig()
        self.endpoints = [f"127.0.0.1:{p}" for p in free_ports(n_pservers)]
        self.servers: List[ParameterServer] = []
        self._stack = ExitStack()

    def transpiler(self, trainer_id: int = 0) -> DistributeTranspiler:
        t = DistributeTranspiler(self.config)
        t.transpile(
            trainer_id,
            program=self.build(),
            pservers=",".join(self.endpoints),
            trainers=self.n_trainers,
            sync_mode=self.sync_mode,
        )
        return t

    def __enter__(self) -> "LocalCluster":
        for ep in self.endpoints:
            self.servers.append(self._start_pserver(ep))
        return self

    def _start_pserver(self, endpoint: str) -> ParameterServer:
        t = self.transpiler()
        prog = t.get_pserver_program(endpoint)
        server = ParameterServer(
            prog, t.get_startup_program(endpoint, prog), tables_from=self.tables_from, security=self.security
        )
        return self._stack.enter_context(server)

    def restart_pserver(self, index: int) -> ParameterServer:
        """Start pserver ``index`` again at its endpoint, as the same command would (it was stopped)."""
        self.servers[index] = self._start_pserver(self.endpoints[index])
        return self.servers[index]

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def trainer(self, trainer_id: int) -> Trainer:
        return Trainer(self.transpiler(trainer_id).get_trainer_program(), self.security)

    def run_trainers(
        self, body: Callable[[Trainer, int], object], ids: Optional[List[int]] = None, timeout: float = 60.0
    ) -> Dict[int, object]:
        """Run ``body(trainer, id)`` for each trainer in its own thread; re-raise any failure.

        Each trainer is closed when its body returns or raises.
        """

        def with_trainer(i: int) -> object:
            with self.trainer(i) as tr:
                return body(tr, i)

        ids = list(range(self.n_trainers)) if ids is None else ids
        return in_threads({i: (lambda i=i: with_trainer(i)) for i in ids}, timeout)


def in_threads(bodies: Dict[int, Callable[[], object]], timeout: float = 60.0) -> Dict[int, object]:
    """Run each of ``bodies`` (by trainer id) in a thread ``trainer-<id>``; their results, or the first
    failure re-raised."""
    results: Dict[int, object] = {}
    errors: Dict[int, BaseException] = {}

    def run(i: int) -> None:
        try:
            results[i] = bodies[i]()
        except BaseException as e:  # reported below, on the test's thread
            errors[i] = e

    threads = [threading.Thread(target=run, args=(i,), name=f"trainer-{i}") for i in bodies]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout)
        if th.is_alive():
            raise TimeoutError(f"{th.name} did not finish within {timeout}s")
    if errors:
        raise next(iter(errors.values()))
    return results
