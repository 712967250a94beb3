"""Access control shared by both roles: a shared auth token and TLS (optionally mutual).

A pserver and its clients (trainers, ``ps-stat``) read the same
:class:`Security` from the environment (``PS_AUTH_TOKEN`` /
``PS_AUTH_TOKEN_FILE``, ``PS_TLS_*``). The server side adds an interceptor
that refuses every call without the token and binds its port with TLS; the
client side opens (secure) channels that send the token on every call. It
lives here, in the package both roles already depend on, because pserver and
trainer must never import each other.
"""

from __future__ import annotations

import collections
import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import List, Mapping, Optional, Sequence, Tuple

import grpc

log = logging.getLogger(__name__)

# (field, environment variable) of every file path a Security may name.
_PATH_FIELDS = (
    ("tls_cert", "PS_TLS_CERT"),
    ("tls_key", "PS_TLS_KEY"),
    ("tls_ca", "PS_TLS_CA"),
    ("tls_client_cert", "PS_TLS_CLIENT_CERT"),
    ("tls_client_key", "PS_TLS_CLIENT_KEY"),
)
_HEADER = "authorization"
_REFUSED = "missing or wrong auth token; set PS_AUTH_TOKEN or PS_AUTH_TOKEN_FILE to the job's token"
# At most one refusal log line per client address per this many seconds: a
# misconfigured trainer retrying in a loop must not flood the pserver's log.
_LOG_EVERY_S = 10.0
_LOG_PEERS_MAX = 1024


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ValueError(f"{what}: cannot read {path!r}: {e.strerror or e}") from None


def _check_token(token: str, what: str) -> str:
    if not token:
        raise ValueError(f"{what} is empty; an empty token would let anyone in")
    # gRPC metadata values must be printable ASCII; anything else fails later, obscurely.
    if not all(0x21 <= ord(c) <= 0x7E for c in token):
        raise ValueError(f"{what} must be printable ASCII without spaces")
    return token


@dataclass
class Security:
    """How a pserver and its clients authenticate each other; all fields None = open, plaintext.

    Every path names a PEM file. The same object (usually from
    :meth:`from_env`) serves both roles: a pserver uses ``tls_cert`` /
    ``tls_key`` and, when ``tls_ca`` is set, requires client certificates
    signed by it; a client verifies the pserver against ``tls_ca`` and, for
    mutual TLS, presents ``tls_client_cert`` / ``tls_client_key``.
    """

    #: Shared secret every call must carry as ``authorization: Bearer <token>``; never logged.
    token: Optional[str] = field(default=None, repr=False)
    #: Server: its certificate chain (PEM path); turns on TLS.
    tls_cert: Optional[str] = None
    #: Server: the private key of ``tls_cert``.
    tls_key: Optional[str] = None
    #: Server: CA that client certificates must chain to (turns on mTLS). Client: CA to verify the server.
    tls_ca: Optional[str] = None
    #: Client: certificate presented to a pserver that requires client certificates.
    tls_client_cert: Optional[str] = None
    #: Client: the private key of ``tls_client_cert``.
    tls_client_key: Optional[str] = None
    #: Client: name checked in the server certificate instead of the endpoint's host.
    tls_server_name: Optional[str] = None

    def __post_init__(self) -> None:
        if self.token is not None:
            _check_token(self.token, "the auth token (PS_AUTH_TOKEN)")
        var = dict(_PATH_FIELDS)
        for a, b in (("tls_cert", "tls_key"), ("tls_client_cert", "tls_client_key")):
            if (getattr(self, a) is None) != (getattr(self, b) is None):
                have, lack = (a, b) if getattr(self, a) is not None else (b, a)
                raise ValueError(f"{have} ({var[have]}) is set but {lack} ({var[lack]}) is not; give both")
        for name, var in _PATH_FIELDS:
            path = getattr(self, name)
            if path is not None:
                if not path:
                    raise ValueError(f"{name} ({var}) is empty")
                if not os.access(path, os.R_OK) or not os.path.isfile(path):
                    raise ValueError(f"{name} ({var}): cannot read {path!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "Security":
        """The job's settings from ``PS_AUTH_TOKEN`` / ``PS_AUTH_TOKEN_FILE`` and ``PS_TLS_*``.

        ``PS_AUTH_TOKEN_FILE`` names a file whose content (stripped) is the
        token; when both variables are set they must agree. ``PS_TLS_CERT``,
        ``PS_TLS_KEY``, ``PS_TLS_CA``, ``PS_TLS_CLIENT_CERT``,
        ``PS_TLS_CLIENT_KEY`` and ``PS_TLS_SERVER_NAME`` fill the fields of
        the same names. A certificate without its key, an unreadable file or
        an empty token raises ValueError naming the variable.
        """
        token = environ.get("PS_AUTH_TOKEN")
        if token is not None:
            _check_token(token, "PS_AUTH_TOKEN")
        token_file = environ.get("PS_AUTH_TOKEN_FILE")
        if token_file is not None:
            if not token_file:
                raise ValueError("PS_AUTH_TOKEN_FILE is empty")
            from_file = _read(token_file, "PS_AUTH_TOKEN_FILE").decode("utf-8", "replace").strip()
            _check_token(from_file, f"the token in PS_AUTH_TOKEN_FILE ({token_file})")
            if token is not None and not hmac.compare_digest(token.encode(), from_file.encode()):
                raise ValueError("PS_AUTH_TOKEN and PS_AUTH_TOKEN_FILE are both set and disagree; unset one")
            token = from_file
        paths = {name: environ.get(var) for name, var in _PATH_FIELDS}
        return cls(token=token, tls_server_name=environ.get("PS_TLS_SERVER_NAME") or None, **paths)

    # -- description ---------------------------------------------------------

    @property
    def tls(self) -> bool:
        """True when a pserver with these settings serves TLS."""
        return self.tls_cert is not None

    def describe(self, server: bool) -> str:
        """A one-line summary for logs ("TLS with client certificates, auth token"); never the token."""
        if server:
            tls = ("TLS with client certificates" if self.tls_ca else "TLS") if self.tls else "plaintext"
        else:
            tls = "TLS" if self._client_tls() else "plaintext"
            if self.tls_client_cert:
                tls += " with a client certificate"
        return f"{tls}, {'auth token' if self.token else 'no auth token'}"

    # -- server side ---------------------------------------------------------

    def check_server(self) -> None:
        """Raise ValueError if a pserver cannot serve with these settings (a CA but no certificate)."""
        if self.tls_ca is not None and not self.tls:
            raise ValueError(
                "PS_TLS_CA is set but PS_TLS_CERT / PS_TLS_KEY are not: a pserver "
                "requiring client certificates needs its own certificate and key"
            )

    def server_interceptors(self, aio: bool = False) -> List[TokenCheck]:
        """Interceptors for ``grpc.server(interceptors=...)`` (``aio``: ``grpc.aio.server``): the token
        check, if set."""
        if not self.token:
            return []
        return [AioTokenAuthInterceptor(self.token) if aio else TokenAuthInterceptor(self.token)]

    def add_port(self, server: grpc.Server, endpoint: str) -> int:
        """Bind ``endpoint`` on ``server``, with TLS when ``tls_cert`` is set; returns the port (0: failed).

        With ``tls_ca`` the server requires and verifies client certificates
        (mutual TLS); otherwise any client that trusts the server may connect
        (and must still present the token, if one is set).
        """
        self.check_server()
        if not self.tls:
            return server.add_insecure_port(endpoint)
        ca = _read(self.tls_ca, "PS_TLS_CA") if self.tls_ca else None
        creds = grpc.ssl_server_credentials(
            [(_read(self.tls_key, "PS_TLS_KEY"), _read(self.tls_cert, "PS_TLS_CERT"))],
            root_certificates=ca,
            require_client_auth=ca is not None,
        )
        return server.add_secure_port(endpoint, creds)

    # -- client side ---------------------------------------------------------

    def _client_tls(self) -> bool:
        # A server certificate in the environment means the job runs TLS: a
        # client sharing that environment (ps-launch) then verifies against the
        # system's roots rather than silently trying plaintext.
        return bool(self.tls_ca or self.tls_client_cert or self.tls_cert)

    def channel(
        self,
        endpoint: str,
        options: Sequence[Tuple[str, object]] = (),
        metadata: Sequence[Tuple[str, str]] = (),
    ) -> grpc.Channel:
        """A channel to ``endpoint`` that satisfies a pserver with these settings.

        Secure (verifying the server against ``tls_ca``, presenting the client
        certificate if given, checking ``tls_server_name`` if given) when TLS
        is configured, plaintext otherwise; when a token is set, every call
        (all four call types, raw multicallables included) carries it, and
        ``metadata`` too.
        """
        options = list(options)
        if self._client_tls():
            creds = grpc.ssl_channel_credentials(
                root_certificates=_read(self.tls_ca, "PS_TLS_CA") if self.tls_ca else None,
                private_key=_read(self.tls_client_key, "PS_TLS_CLIENT_KEY") if self.tls_client_key else None,
                certificate_chain=(
                    _read(self.tls_client_cert, "PS_TLS_CLIENT_CERT") if self.tls_client_cert else None
                ),
            )
            if self.tls_server_name:
                options.append(("grpc.ssl_target_name_override", self.tls_server_name))
            ch = grpc.secure_channel(endpoint, creds, options=options)
        else:
            ch = grpc.insecure_channel(endpoint, options=options)
        entries = [(_HEADER, f"Bearer {self.token}")] if self.token else []
        entries += list(metadata)
        if entries:
            ch = grpc.intercept_channel(ch, MetadataClientInterceptor(entries))
        return ch


# -- interceptors --------------------------------------------------------------


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


class MetadataClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``entries`` (the token's ``authorization: Bearer <token>``, the trainer id) to every call's
    metadata."""

    def __init__(self, entries: Sequence[Tuple[str, str]]):
        self._entries = list(entries)
        self._keys = {key for key, _ in self._entries}

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        metadata = [m for m in (d.metadata or ()) if m[0] not in self._keys] + self._entries
        return _CallDetails(
            d.method,
            d.timeout,
            metadata,
            d.credentials,
            getattr(d, "wait_for_ready", None),
            getattr(d, "compression", None),
        )

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


class _RefusalLog:
    """Logs refused calls at WARNING, at most once per client address per ``_LOG_EVERY_S``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = {}  # address -> monotonic time of its last line
        self._suppressed = {}  # address -> refusals not logged since

    def __call__(self, peer: str, method: str) -> None:
        # "ipv4:10.0.0.5:53122": the port changes per connection, the client does not.
        address = peer.rsplit(":", 1)[0] if peer.count(":") > 1 else peer
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(address, -_LOG_EVERY_S) < _LOG_EVERY_S:
                self._suppressed[address] = self._suppressed.get(address, 0) + 1
                return
            if len(self._last) >= _LOG_PEERS_MAX:  # bound memory against many distinct clients
                stale = [a for a, t in self._last.items() if now - t >= _LOG_EVERY_S]
                for a in stale or list(self._last):
                    self._last.pop(a, None)
                    self._suppressed.pop(a, None)
            self._last[address] = now
            more = self._suppressed.pop(address, 0)
        log.warning(
            "refused %s from %s: missing or wrong auth token%s",
            method,
            peer,
            f" ({more} more refused from {address} since the last report)" if more else "",
        )


class TokenCheck:
    """The token check both server interceptors share: which calls pass, and the count and log of refusals.

    Every call whose ``authorization`` is not ``Bearer <token>`` is refused
    with UNAUTHENTICATED, on every service of the server (the pserver's,
    health, reflection), before any servicer code runs: a refused call
    changes nothing.
    """

    def __init__(self, token: str):
        self._expected = f"Bearer {_check_token(token, 'the auth token')}".encode()
        self._log = _RefusalLog()
        # Calls refused so far (the pserver's metrics report them as reason "auth").
        self.refused = 0
        self._count = threading.Lock()

    def _authorized(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == _HEADER:
                got = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
                return hmac.compare_digest(got, self._expected)
        return False

    def _refused(self, context, method: str) -> str:
        """Count and log one refusal; the details to abort it with."""
        with self._count:
            self.refused += 1
        self._log(context.peer() or "unknown peer", method)
        return f"pserver: {method}: {_REFUSED}"

    @staticmethod
    def _shaped(handler, refuse):
        # The refusal must have the real method's shape, or gRPC mis-handles the stream.
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(refuse)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(refuse)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


class TokenAuthInterceptor(TokenCheck, grpc.ServerInterceptor):
    """The token check (:class:`TokenCheck`) on a threaded ``grpc.server``."""

    def intercept_service(self, continuation, handler_call_details):
        """Pass the call on when its token matches; otherwise a handler that aborts UNAUTHENTICATED."""
        if self._authorized(handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        def refuse(request_or_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refused(context, method))

        return self._shaped(handler, refuse)


class AioTokenAuthInterceptor(TokenCheck, grpc.aio.ServerInterceptor):
    """The token check (:class:`TokenCheck`) on gRPC's asyncio server (the pserver's main port)."""

    async def intercept_service(self, continuation, handler_call_details):
        """Pass the call on when its token matches; otherwise a handler that aborts UNAUTHENTICATED."""
        if self._authorized(handler_call_details.invocation_metadata):
            return await continuation(handler_call_details)
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method

        async def refuse(request_or_iterator, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refused(context, method))

        return self._shaped(handler, refuse)
