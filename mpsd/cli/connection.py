"""The options every command that calls the daemon takes: address, timeout, TLS files and token.

mpsd.connect.open_channel reads them back; the names here and there must agree.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mpsd.connect import DEFAULT_ADDRESS, TOKEN_ENV


def add_connection_args(parser: argparse.ArgumentParser, timeout: float) -> None:
    parser.add_argument(
        "--address",
        default=DEFAULT_ADDRESS,
        help=f"the daemon's gRPC host:port or unix:///path (default {DEFAULT_ADDRESS})",
    )
    parser.add_argument(
        "--timeout", type=float, default=timeout, help=f"seconds to wait for the daemon (default {timeout:g})"
    )
    add_credential_args(parser)


def add_credential_args(parser: argparse.ArgumentParser) -> None:
    """TLS and token options, for every tool that calls the daemon (the service installer's probe too)."""
    parser.add_argument("--tls-ca", type=Path, help="CA certificate to verify a TLS daemon with")
    parser.add_argument("--tls-cert", type=Path, help="client certificate, for a daemon that requires one")
    parser.add_argument("--tls-key", type=Path, help="the client certificate's key")
    parser.add_argument(
        "--token-file", type=Path, help=f"file holding a bearer token (else ${TOKEN_ENV} if set)"
    )
