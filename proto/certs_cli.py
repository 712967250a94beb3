"""``ps-certs DIR [--hosts 127.0.0.1,localhost] [--days 30]``: test certificates in one command.

Writes ``ca.pem ca.key server.pem server.key client.pem client.key`` into DIR
(see :func:`psproto.certs.make_test_certs`) and prints the ``PS_TLS_*``
variables that use them. For trying TLS and for tests; use your own CA in production.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .certs import FILES, make_test_certs


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``ps-certs DIR``: make the certificates, print the variables; 2 on bad input."""
    p = argparse.ArgumentParser(
        prog="ps-certs", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("directory", metavar="DIR", help="where the six PEM files go (created if needed)")
    p.add_argument(
        "--hosts",
        default="127.0.0.1,localhost",
        help="comma-separated IPs / DNS names the server certificate is valid for "
        "(default: 127.0.0.1,localhost)",
    )
    p.add_argument("--days", type=int, default=30, help="validity in days (default 30)")
    p.add_argument("--no-overwrite", action="store_true", help="refuse to replace existing files")
    args = p.parse_args(argv)
    try:
        paths = make_test_certs(
            args.directory, args.hosts.split(","), args.days, overwrite=not args.no_overwrite
        )
    except (ValueError, ImportError, OSError) as e:
        print(f"{p.prog}: error: {e}", file=sys.stderr)
        return 2
    absolute = {k: os.path.abspath(v) for k, v in paths.items()}
    print(f"wrote {', '.join(FILES)} to {os.path.abspath(args.directory)}")
    print("# pservers:")
    print(f"export PS_TLS_CERT={absolute['server_cert']} PS_TLS_KEY={absolute['server_key']}")
    print("# trainers and ps-stat (PS_TLS_CA on a pserver also requires client certificates):")
    print(f"export PS_TLS_CA={absolute['ca']}")
    print(f"export PS_TLS_CLIENT_CERT={absolute['client_cert']} PS_TLS_CLIENT_KEY={absolute['client_key']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
