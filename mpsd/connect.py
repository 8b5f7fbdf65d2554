"""How the command-line tools reach a running daemon: address, TLS and token, the same for every command.

The options that fill these in are mpsd.cli.connection's; the service installer's health probe uses this too.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

DEFAULT_ADDRESS = "127.0.0.1:8001"
TOKEN_ENV = "MPSD_TOKEN"
# No client-side size limits: the daemon enforces its own.
_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


class _BearerToken(grpc.AuthMetadataPlugin):  # type: ignore[misc]
    def __init__(self, token: str) -> None:
        self._metadata = (("authorization", f"Bearer {token}"),)

    def __call__(self, context: Any, callback: Callable[..., None]) -> None:
        callback(self._metadata, None)


class _TokenInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[misc]
    """Adds the token on plaintext channels (loopback or a Unix socket), where call credentials cannot go."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: Any) -> Any:
        metadata = [*(details.metadata or ()), self._header]
        return details._replace(metadata=metadata)

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._with_token(details), request)


def _token(args: argparse.Namespace) -> str | None:
    path: Path | None = getattr(args, "token_file", None)
    if path is not None:
        return path.read_text().strip()
    return os.environ.get(TOKEN_ENV) or None


def open_channel(args: argparse.Namespace) -> grpc.Channel:
    """A channel to the daemon named by the connection arguments (TLS when a CA is given)."""
    token = _token(args)
    ca: Path | None = getattr(args, "tls_ca", None)
    if ca is not None:
        cert, key = getattr(args, "tls_cert", None), getattr(args, "tls_key", None)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=ca.read_bytes(),
            private_key=key.read_bytes() if key else None,
            certificate_chain=cert.read_bytes() if cert else None,
        )
        if token:
            credentials = grpc.composite_channel_credentials(
                credentials, grpc.metadata_call_credentials(_BearerToken(token))
            )
        return grpc.secure_channel(args.address, credentials, options=_OPTIONS)
    channel = grpc.insecure_channel(args.address, options=_OPTIONS)
    return grpc.intercept_channel(channel, _TokenInterceptor(token)) if token else channel
