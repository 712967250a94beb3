"""etcd's v3 HTTP gateway as :mod:`.etcd` reaches it: one or more URLs, and the requests of a transaction.

:class:`Gateway` makes each call against the URLs in order while they refuse connections, under one
lock (a ``requests.Session`` is not documented thread-safe), and turns every failure into a
:class:`~.coordination.CoordinationError`. :func:`compare`, :func:`put_request` and :func:`range_request` are
the parts of a transaction as the gateway's JSON spells them.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Callable, Dict, List, Optional, TypeVar
from urllib.parse import urlsplit

import requests
from etcd3gw import exceptions as etcd_exceptions
from etcd3gw.client import Etcd3Client
from etcd3gw.utils import _encode

from .coordination import CoordinationError

T = TypeVar("T")


def detail(e: BaseException) -> str:
    """What an etcd3gw or requests error says, cut to 400 characters."""
    text = getattr(e, "detail_text", None) or str(e) or type(e).__name__
    return text if len(text) <= 400 else text[:400] + "..."


class Gateway:
    """etcd's HTTP gateway at one or more URLs, tried in order while they refuse connections. A timeout is
    not retried elsewhere: the request may have been applied."""

    def __init__(self, urls: List[str], timeout: float):
        self.urls = urls
        self._clients: List[Etcd3Client] = []
        for url in urls:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"etcd endpoint {url!r} is not an http(s)://HOST:PORT URL")
            # api_path given: etcd3gw would otherwise ask /version first, on every new client.
            self._clients.append(
                Etcd3Client(
                    host=parts.hostname,
                    port=parts.port or 2379,
                    protocol=parts.scheme,
                    timeout=timeout,
                    api_path="/v3/",
                )
            )
        self._lock = threading.Lock()  # requests.Session is not documented thread-safe

    def call(self, op: str, fn: Callable[[Etcd3Client], T]) -> T:
        """``fn(client)`` at the first URL that takes the connection; ``op`` names it in a failure."""
        with self._lock:
            refused = []
            for url, client in zip(self.urls, self._clients):
                try:
                    return fn(client)
                except etcd_exceptions.ConnectionFailedError as e:
                    refused.append(f"{url} ({detail(e)})")
                except (etcd_exceptions.Etcd3Exception, requests.RequestException, ValueError, KeyError) as e:
                    raise CoordinationError(f"etcd at {url}: {op} failed: {detail(e)}") from e
            raise CoordinationError(f"etcd: {op} failed: could not connect to {'; '.join(refused)}")

    def close(self) -> None:
        """Close every URL's session."""
        for c in self._clients:
            c.session.close()


def compare(key: bytes, target: str, revision: int) -> Dict[str, Any]:
    """A transaction's compare: ``key``'s create (``target`` "CREATE") or mod revision equals ``revision``."""
    return {
        "key": _encode(key),
        "result": "EQUAL",
        "target": target,
        ("create_revision" if target == "CREATE" else "mod_revision"): str(revision),
    }


def put_request(key: bytes, value: Dict[str, Any], lease: Optional[int] = None) -> Dict[str, Any]:
    """A transaction's request: ``value`` as JSON at ``key``, on ``lease`` if given."""
    put: Dict[str, Any] = {"key": _encode(key), "value": _encode(json.dumps(value, sort_keys=True).encode())}
    if lease is not None:
        put["lease"] = str(lease)  # int64 as a string: lease ids exceed JSON's exact integers
    return {"request_put": put}


def range_request(key: bytes) -> Dict[str, Any]:
    """A transaction's request: the value at ``key``."""
    return {"request_range": {"key": _encode(key)}}
