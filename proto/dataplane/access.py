"""The data channel's access control: the same token and TLS as gRPC's, for plain sockets.

A pserver's data port is as closed as its gRPC port (:class:`psproto.security.Security` from the same
``PS_AUTH_TOKEN`` / ``PS_TLS_*`` settings): TLS with the same certificate and key, client certificates
required when ``PS_TLS_CA`` is set on the pserver, the token compared in constant time. A trainer
verifies the pserver as its gRPC channel does (``PS_TLS_CA``, ``PS_TLS_SERVER_NAME``) and presents its
client certificate for mutual TLS.
"""

from __future__ import annotations

import hmac
import ssl
from typing import Optional

from ..security import Security


def server_context(security: Security) -> Optional[ssl.SSLContext]:
    """The TLS context of a pserver's data port (None: plaintext, as its gRPC port then is)."""
    security.check_server()
    if not security.tls:
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(security.tls_cert, security.tls_key)
    if security.tls_ca:
        context.load_verify_locations(security.tls_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(security: Security) -> Optional[ssl.SSLContext]:
    """The TLS context of a trainer's data connections (None: plaintext), verifying as gRPC's channel does."""
    if not (security.tls_ca or security.tls_client_cert or security.tls_cert):
        return None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if security.tls_ca:
        context.load_verify_locations(security.tls_ca)
    else:
        context.load_default_certs()
    if security.tls_client_cert:
        context.load_cert_chain(security.tls_client_cert, security.tls_client_key)
    return context


def server_name(security: Security, host: str) -> str:
    """The name a trainer checks the pserver's certificate against: ``PS_TLS_SERVER_NAME`` or the host."""
    return security.tls_server_name or host


def token_matches(expected: Optional[str], given: str) -> bool:
    """Whether a connection's token is the job's (any token when none is set); constant time."""
    if not expected:
        return True
    return hmac.compare_digest(expected.encode(), given.encode())
