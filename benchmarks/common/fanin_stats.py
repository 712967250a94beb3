"""The emulated fan-in's view of its pservers: ``Stats`` of each shard as an observer (no session), each call
with a deadline; with hot standby, of whichever of the shard's two processes leads now (``Lead``)."""

from __future__ import annotations

import time
from typing import Callable, Dict, Optional, Sequence

from harness.processes import RunFailed


class PserverStats:
    """``Stats`` of every shard of a run, by its pserver endpoint. ``replicas`` (hot standby): each shard's
    second process, in the same order."""

    def __init__(self, endpoints: Sequence[str], replicas: Sequence[str] = ()):
        from psproto import ps_pb2_grpc
        from psproto.security import Security

        security = Security.from_env()
        self._shards = {ep: [ep, *([replicas[k]] if replicas else [])] for k, ep in enumerate(endpoints)}
        self._channels = {p: security.channel(p) for group in self._shards.values() for p in group}
        self._stubs = {p: ps_pb2_grpc.ParameterServerStub(ch) for p, ch in self._channels.items()}

    def leader(self, endpoint: str, timeout: float = 0.5) -> Optional[str]:
        """The process of ``endpoint``'s shard that leads it now (without replicas: ``endpoint``); None if
        none says so."""
        import grpc

        from psproto import ps_pb2

        group = self._shards[endpoint]
        if len(group) == 1:
            return endpoint
        for process in group:
            try:
                if self._stubs[process].Lead(ps_pb2.LeadRequest(), timeout=timeout).role == "primary":
                    return process
            except grpc.RpcError:
                continue
        return None

    def get(self, timeout: float = 10.0) -> Dict[str, object]:
        """{shard's endpoint: ``Stats`` of its leading process}; gRPC's error if one does not answer,
        LookupError if a shard has no leader yet."""
        from psproto import ps_pb2

        answers = {}
        for ep in self._shards:
            process = self.leader(ep, timeout)
            if process is None:
                raise LookupError(f"no process of shard {ep} leads it yet")
            answers[ep] = self._stubs[process].Stats(ps_pb2.StatsRequest(), timeout=timeout)
        return answers

    def of(self, endpoint: str, timeout: float = 0.5):
        """``Stats`` of the process leading ``endpoint``'s shard, None while none answers (killed, starting,
        or a backup not yet leading)."""
        import grpc

        from psproto import ps_pb2

        process = self.leader(endpoint, timeout)
        if process is None:
            return None
        try:
            return self._stubs[process].Stats(ps_pb2.StatsRequest(), timeout=timeout)
        except grpc.RpcError:
            return None

    def wait_up(self, deadline: float, check_alive: Callable[[], None]) -> None:
        """Return once every shard's leading process answers Stats (with hot standby: with its backup in
        sync, so that losing either process loses nothing); ``check_alive()`` raises if a process exited;
        RunFailed past ``deadline``."""
        import grpc

        while True:
            try:
                answers = self.get(timeout=1.0)
                if all(len(g) == 1 for g in self._shards.values()) or all(
                    a.replica.backup_in_sync for a in answers.values()
                ):
                    return
                raise LookupError("a backup is not in sync yet")
            except (grpc.RpcError, LookupError):
                check_alive()
                if time.monotonic() > deadline:
                    raise RunFailed("the pservers did not answer Stats in time") from None
                time.sleep(0.05)

    def close(self) -> None:
        for ch in self._channels.values():
            ch.close()
