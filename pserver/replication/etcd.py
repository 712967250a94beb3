"""The :class:`~.coordination.Coordinator` over etcd (>= 3.4): leases, one-winner campaigns, fencing epochs.

etcd is reached through its HTTP gateway (:mod:`.etcd_gateway`) with etcd3gw (OpenStack's client): a gRPC
etcd client would pin a grpcio version that conflicts with the pservers' own. Failures are
:class:`~.coordination.CoordinationError`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from types import MappingProxyType
from typing import Any, Callable, Dict, Mapping, Optional, Tuple
from urllib.parse import urlsplit

import requests
from etcd3gw import exceptions as etcd_exceptions
from etcd3gw.client import Etcd3Client
from etcd3gw.lease import Lease
from etcd3gw.utils import _increment_last_byte
from etcd3gw.watch import Watcher

from .coordination import CoordinationError, Coordinator, InSync, Leader, may_campaign
from .etcd_gateway import Gateway, compare, detail, put_request, range_request

log = logging.getLogger(__name__)


class EtcdCoordinator(Coordinator):
    """:class:`Coordinator` over etcd's v3 HTTP gateway (etcd >= 3.4) at ``endpoints`` (comma-separated
    URLs)."""

    def __init__(
        self,
        endpoints: str,
        prefix: str,
        shard: int,
        replica_id: str,
        ttl: int = 1,
        on_lost: Optional[Callable[[int], None]] = None,
        timeout: float = 2.0,
    ):
        if not isinstance(ttl, int) or isinstance(ttl, bool) or ttl < 1:
            raise ValueError(f"ttl must be a whole number of seconds >= 1 (etcd's lease unit), got {ttl!r}")
        urls = [u.strip().rstrip("/") for u in endpoints.split(",") if u.strip()]
        if not urls:
            raise ValueError(f"no etcd endpoint in {endpoints!r}")
        self._replica_id = replica_id
        self._ttl = ttl
        self._margin = ttl / 4
        self._on_lost = on_lost
        self._base = f"{prefix.rstrip('/')}/shard-{shard}"
        self._primary_key = f"{self._base}/primary".encode()
        self._in_sync_key = f"{self._base}/in_sync".encode()
        self._gw = Gateway(urls, timeout)
        # Its own sessions, and a deadline within the margin: a stalled keep-alive must not hide the lease's
        # end.
        self._keepalive_gw = Gateway(urls, min(timeout, self._margin))
        self._lock = threading.Lock()  # guards the lease state below
        self._campaign_lock = threading.Lock()
        self._lease: Optional[int] = None
        self._renewed_at = 0.0  # monotonic time the last successful grant/keep-alive was sent
        self._epoch: Optional[int] = None  # the epoch this process leads at, None when not leading
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def replica_id(self) -> str:
        return self._replica_id

    def _get(self, key: bytes, what: str) -> Tuple[Optional[Dict[str, Any]], Dict[str, Any]]:
        kvs = self._gw.call(f"read {what} of {self._base}", lambda c: c.get(key, metadata=True))
        if not kvs:
            return None, {}
        try:
            return json.loads(kvs[0][0]), kvs[0][1]
        except ValueError as e:
            raise CoordinationError(
                f"etcd at {', '.join(self._gw.urls)}: {key.decode()} holds no JSON: {kvs[0][0][:200]!r}"
            ) from e

    def leader(self) -> Optional[Leader]:
        value, meta = self._get(self._primary_key, "primary")
        # The create revision, not the value's "epoch": that one is stamped by a second transaction.
        return (
            None
            if value is None
            else Leader(
                endpoint=value["endpoint"], replica_id=value["replica_id"], epoch=int(meta["create_revision"])
            )
        )

    def in_sync(self) -> Optional[InSync]:
        value, meta = self._get(self._in_sync_key, "in_sync")
        return (
            None
            if value is None
            else InSync(
                replicas=tuple(value["replicas"]),
                endpoints=MappingProxyType(dict(value["endpoints"])),
                epoch=int(value["epoch"]),
                lineage=str(value["lineage"]),
                revision=int(meta["mod_revision"]),
            )
        )

    def _fresh(self) -> bool:
        """Whether the lease (if any) certainly has not expired yet; the caller holds the lock."""
        return self._lease is not None and time.monotonic() < self._renewed_at + self._ttl - self._margin

    def _ensure_lease(self) -> int:
        with self._lock:
            if self._fresh():
                return self._lease
        sent = time.monotonic()
        granted = self._gw.call(
            "lease grant", lambda c: c.post(c.get_url("/lease/grant"), json={"TTL": self._ttl, "ID": 0})
        )
        lease, ttl = int(granted["ID"]), int(granted.get("TTL", 0))
        if ttl != self._ttl:
            # etcd raises TTLs below 1.5 x its election timeout; holds() keeps counting the requested
            # (shorter) one.
            log.warning(
                "etcd granted a %d s lease for the requested %d s: a dead primary of %s is replaced only "
                "after %d s (etcd's minimum TTL is 1.5 x --election-timeout)",
                ttl,
                self._ttl,
                self._base,
                ttl,
            )
        with self._lock:
            self._lease, self._renewed_at = lease, sent
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._keep_alive, name=f"etcd-keepalive-{self._base}", daemon=True
                )
                self._thread.start()
        return lease

    def campaign(self, endpoint: str, lineage: str, force: bool = False) -> Optional[int]:
        with self._campaign_lock:
            with self._lock:
                epoch, lease, fresh = self._epoch, self._lease, self._fresh()
            if epoch is not None and fresh:
                return epoch  # already leads
            if epoch is not None and lease is not None:  # past its deadline, unnoticed by the keep-alive
                self._lose(lease, "no keep-alive succeeded in time")
            current = self.in_sync()
            if not may_campaign(current, self._replica_id, force):
                log.info(
                    "%s: %s may not lead: not in the in-sync list %s",
                    self._base,
                    self._replica_id,
                    list(current.replicas) if current else None,
                )
                return None
            revision = current.revision if current is not None else 0
            lease = self._ensure_lease()
            me = {"endpoint": endpoint, "replica_id": self._replica_id}
            try:
                won = self._gw.call(
                    f"campaign for {self._base}",
                    lambda c: c.transaction(
                        {
                            "compare": [
                                compare(self._primary_key, "CREATE", 0),
                                compare(self._in_sync_key, "MOD", revision),
                            ],
                            "success": [put_request(self._primary_key, {**me, "epoch": 0}, lease)],
                            "failure": [],
                        }
                    ),
                )
            except CoordinationError:
                # It may have been applied (a lost answer): a primary key on a lease kept alive by a process
                # that believes it lost would block the shard, so let the lease go.
                self.resign()
                raise
            if not won.get("succeeded"):  # etcd's gateway omits false
                return None
            epoch = int(won["header"]["revision"])
            # The epoch is known only now: stamp it, and the in-sync list, while both are as the decision saw
            # them.
            stored = lineage if force or current is None else current.lineage
            try:
                stamped = self._gw.call(
                    f"stamp epoch {epoch} of {self._base}",
                    lambda c: c.transaction(
                        {
                            "compare": [
                                compare(self._primary_key, "CREATE", epoch),
                                compare(self._in_sync_key, "MOD", revision),
                            ],
                            "success": [
                                put_request(self._primary_key, {**me, "epoch": epoch}, lease),
                                put_request(
                                    self._in_sync_key,
                                    {
                                        "replicas": [self._replica_id],
                                        "endpoints": {self._replica_id: endpoint},
                                        "epoch": epoch,
                                        "lineage": stored,
                                    },
                                ),
                            ],
                            "failure": [],
                        }
                    ),
                )
            except CoordinationError:
                self.resign()  # nothing acknowledged yet: give the lead back rather than hold it half-made
                raise
            if not stamped.get("succeeded"):
                log.warning("%s: %s lost epoch %d before recording it", self._base, self._replica_id, epoch)
                self.resign()
                return None
            with self._lock:
                self._epoch = epoch
            log.info("%s: %s leads at epoch %d (lineage %s)", self._base, self._replica_id, epoch, stored)
            return epoch

    def set_in_sync(self, epoch: int, replicas: Mapping[str, str]) -> bool:
        if not replicas:
            raise ValueError(f"an empty in-sync list for {self._base}: no replica could ever lead it again")
        for _ in range(3):
            current = self.in_sync()
            value = {
                "replicas": sorted(replicas),
                "endpoints": dict(replicas),
                "epoch": epoch,
                "lineage": current.lineage if current is not None else "",
            }
            txn = {
                "compare": [
                    compare(self._primary_key, "CREATE", epoch),
                    compare(self._in_sync_key, "MOD", current.revision if current is not None else 0),
                ],
                "success": [put_request(self._in_sync_key, value)],
                "failure": [range_request(self._primary_key)],
            }
            answer = self._gw.call(f"set in_sync of {self._base}", lambda c: c.transaction(txn))
            if answer.get("succeeded"):
                return True
            kvs = answer["responses"][0]["response_range"].get("kvs", [])  # the failure branch's range
            kv = kvs[0] if kvs else None
            if kv is None or int(kv["create_revision"]) != epoch:
                log.warning(
                    "%s: %s no longer leads at epoch %d (primary %s)",
                    self._base,
                    self._replica_id,
                    epoch,
                    "absent" if kv is None else f"at epoch {kv['create_revision']}",
                )
                return False
            # Still primary at epoch: the list changed since read (a concurrent call of ours); read it again.
        raise CoordinationError(
            f"etcd at {', '.join(self._gw.urls)}: {self._base}/in_sync kept changing "
            f"under the primary at epoch {epoch}"
        )

    def holds(self, epoch: int) -> bool:
        with self._lock:
            return self._epoch == epoch and self._fresh()

    def _keep_alive(self) -> None:
        interval = self._ttl / 4
        next_at = time.monotonic() + interval
        failing = False
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            next_at = time.monotonic() + interval
            with self._lock:
                lease = self._lease
            if lease is None:
                continue
            sent = time.monotonic()
            try:
                ttl = self._keepalive_gw.call("lease keep-alive", lambda c: Lease(lease, c).refresh())
            except CoordinationError as e:
                if not failing:
                    log.warning("%s: %s", self._base, e)
                failing = True
                with self._lock:
                    expired = self._lease == lease and not self._fresh()
                if expired:
                    self._lose(lease, f"no keep-alive succeeded for {self._ttl - self._margin:g}s ({e})")
                continue
            failing = False
            if ttl <= 0:
                self._lose(lease, "etcd says the lease expired")
                continue
            with self._lock:
                if self._lease == lease:
                    self._renewed_at = max(self._renewed_at, sent)

    def _lose(self, lease: int, why: str) -> None:
        with self._lock:
            if self._lease != lease:
                return  # resigned meanwhile
            epoch, self._lease, self._epoch = self._epoch, None, None
        log.log(
            logging.INFO if epoch is None else logging.ERROR,
            "%s: %s lost its lease%s: %s",
            self._base,
            self._replica_id,
            "" if epoch is None else f" and the lead at epoch {epoch}",
            why,
        )
        if epoch is not None and self._on_lost is not None:
            try:
                self._on_lost(epoch)
            except Exception:  # noqa: BLE001 - the keep-alive thread must survive its callback
                log.exception("%s: on_lost(%d) failed", self._base, epoch)

    def resign(self) -> None:
        with self._lock:
            lease, epoch, self._lease, self._epoch = self._lease, self._epoch, None, None
        if lease is None:
            return
        try:
            self._gw.call(f"revoke the lease of {self._base}", lambda c: Lease(lease, c).revoke())
            if epoch is not None:
                log.info("%s: %s resigned the lead at epoch %d", self._base, self._replica_id, epoch)
        except Exception as e:  # noqa: BLE001 - never raises: the lease expires by itself
            log.warning(
                "%s: resigning %s failed (its lease expires within %d s): %s",
                self._base,
                self._replica_id,
                self._ttl,
                e,
            )

    def watch(self, on_change: Callable[[], None]) -> None:
        """etcd's watch on the shard's keys (one streamed HTTP request, its own session), calling
        ``on_change``."""
        self._unwatch()
        url = urlsplit(self._gw.urls[0])
        client = Etcd3Client(host=url.hostname, port=url.port or 2379, protocol=url.scheme, api_path="/v3/")
        prefix = f"{self._base}/".encode()
        try:
            self._watcher = (
                Watcher(client, prefix, lambda event: on_change(), range_end=_increment_last_byte(prefix)),
                client,
            )
        except (etcd_exceptions.Etcd3Exception, requests.RequestException) as e:
            client.session.close()
            log.info("%s: no watch (%s); changes are found by reading", self._base, detail(e))

    def _unwatch(self) -> None:
        watcher, self._watcher = getattr(self, "_watcher", None), None
        if watcher is not None:
            try:
                watcher[0].stop()
                watcher[1].session.close()
            except Exception:  # noqa: BLE001 - a stream already broken
                log.debug("stopping the watch of %s failed", self._base, exc_info=True)

    def close(self) -> None:
        self._unwatch()
        with self._lock:
            self._lease, self._epoch = None, None  # no longer kept alive: it expires within the TTL
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=self._ttl + 5)
        try:
            self._gw.close()
            self._keepalive_gw.close()
        except Exception:  # noqa: BLE001 - never raises
            log.debug("closing the etcd sessions of %s failed", self._base, exc_info=True)
