"""Make a throw-away CA plus a server and a client certificate, for trying TLS and for tests.

:func:`make_test_certs` (``ps-certs DIR`` on the command line, see
:mod:`psproto.certs_cli`) writes ``ca.pem ca.key server.pem server.key
client.pem client.key`` into DIR. The CA signs both
certificates; the server certificate names the given hosts (DNS names or IP
addresses). For real deployments use your organisation's CA.
Needs the ``cryptography`` package (``pip install 'torch-pserver[tls]'``).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from typing import Dict, Sequence

FILES = ("ca.pem", "ca.key", "server.pem", "server.key", "client.pem", "client.key")


def _san(hosts: Sequence[str]):
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def make_test_certs(
    directory: str, hosts: Sequence[str] = ("127.0.0.1", "localhost"), days: int = 30, overwrite: bool = True
) -> Dict[str, str]:
    """Write a CA and the server / client certificates it signs into ``directory``; return their paths.

    Keys are ECDSA P-256 (fast to make, supported by gRPC), written unencrypted
    with mode 0600. The server certificate has the serverAuth usage and
    ``hosts`` as subject alternative names (IP addresses or DNS names); the
    client certificate has clientAuth. The returned dict maps ``ca``,
    ``ca_key``, ``server_cert``, ``server_key``, ``client_cert``,
    ``client_key`` to paths. With ``overwrite=False`` existing files raise
    FileExistsError rather than being replaced.
    """
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError as e:  # only this helper needs it; say how to get it
        raise ImportError(
            "making test certificates needs the 'cryptography' package: pip install 'torch-pserver[tls]'"
        ) from e
    hosts = [h.strip() for h in hosts if h and h.strip()]
    if not hosts:
        raise ValueError("give at least one host for the server certificate")
    if days < 1:
        raise ValueError(f"days must be >= 1, got {days}")
    os.makedirs(directory, exist_ok=True)
    paths = {
        key: os.path.join(directory, name)
        for key, name in zip(
            ("ca", "ca_key", "server_cert", "server_key", "client_cert", "client_key"), FILES
        )
    }
    if not overwrite:
        existing = [p for p in paths.values() if os.path.exists(p)]
        if existing:
            raise FileExistsError(f"{', '.join(existing)} exist; not overwriting")

    # Backdated a little so a peer whose clock lags still accepts a fresh certificate.
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    until = now + datetime.timedelta(days=days)

    def name(cn: str):
        return x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "torch-pserver test"),
                x509.NameAttribute(NameOID.COMMON_NAME, cn),
            ]
        )

    def build(subject, key, issuer, issuer_key, *, ca: bool, eku=None, san=None):
        b = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(until)
            .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=not ca,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=ca,
                    crl_sign=ca,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False
            )
        )
        if eku is not None:
            b = b.add_extension(x509.ExtendedKeyUsage([eku]), critical=False)
        if san is not None:
            b = b.add_extension(san, critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    def write(path: str, data: bytes, private: bool) -> None:
        # Create with the final mode: a key must never be readable by others, even briefly.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if private:
            os.chmod(path, 0o600)

    def pem_key(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = name("torch-pserver test CA")
    ca_cert = build(ca_name, ca_key, ca_name, ca_key, ca=True)
    server_key = ec.generate_private_key(ec.SECP256R1())
    server_cert = build(
        name(hosts[0]),
        server_key,
        ca_name,
        ca_key,
        ca=False,
        eku=ExtendedKeyUsageOID.SERVER_AUTH,
        san=_san(hosts),
    )
    client_key = ec.generate_private_key(ec.SECP256R1())
    client_cert = build(
        name("torch-pserver client"),
        client_key,
        ca_name,
        ca_key,
        ca=False,
        eku=ExtendedKeyUsageOID.CLIENT_AUTH,
    )
    pem = serialization.Encoding.PEM
    write(paths["ca"], ca_cert.public_bytes(pem), False)
    write(paths["ca_key"], pem_key(ca_key), True)
    write(paths["server_cert"], server_cert.public_bytes(pem), False)
    write(paths["server_key"], pem_key(server_key), True)
    write(paths["client_cert"], client_cert.public_bytes(pem), False)
    write(paths["client_key"], pem_key(client_key), True)
    return paths
