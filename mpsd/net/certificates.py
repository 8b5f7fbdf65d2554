"""The TLS certificate a port serves with, replaceable while it serves (SIGHUP), without a restart.

gRPC asks `Certificates` for a new certificate at every TLS handshake (dynamic server credentials), so a
certificate renewed on disk and re-read at SIGHUP reaches every new connection; connections already open
keep the session they have. The daemon reads the files once and hands the bytes to its front processes, so
the daemon and every front serve the same certificate, and a front started later gets the current one.
The HTTP server's `SslContexts` do the same with Python's ssl module: each handshake takes the context
made from the current material.
"""

from __future__ import annotations

import os
import ssl
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from mpsd.config.security import TlsConfig
from mpsd.errors import ConfigError

# PEM files are ASCII; latin-1 carries any byte through JSON unchanged, so a damaged file fails where it
# is parsed, with gRPC's message, not in transit.
_TEXT = "latin-1"


def _no_password() -> bytes:
    """An encrypted key fails to load (gRPC cannot use one) instead of OpenSSL asking on the terminal."""
    return b""


def _check_certificates(context: ssl.SSLContext, name: str, path: Path | None, pem: bytes) -> None:
    """The file holds at least one certificate that parses; ConfigError names the field otherwise."""
    try:
        context.load_verify_locations(cadata=pem.decode(_TEXT))
    except (ssl.SSLError, ValueError) as exc:
        raise ConfigError(f"{name}: {path} holds no usable PEM certificate: {exc}") from None


@dataclass(frozen=True)
class TlsMaterial:
    """The PEM bytes of one TLS setup: certificate chain, private key, and the client CA (mutual TLS)."""

    chain: bytes
    key: bytes = field(repr=False)  # never in a log line or a traceback
    client_ca: bytes | None

    @classmethod
    def read(cls, tls: TlsConfig) -> TlsMaterial:
        """Read the three files and check that they can be served with.

        gRPC parses them only at a handshake, where a bad file would fail every new client and say nothing
        in the log; OpenSSL (the `ssl` module) checks them here instead, so a damaged or mismatched file
        stops the start, or the reload, with the field named. The module reads keys only from files, so
        the pair is checked from its paths and then read again: bytes that changed meanwhile (a renewal
        caught between its certificate and its key) are refused rather than served unchecked.
        """
        chain, key, client_ca = tls.read()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        _check_certificates(context, "tls.cert_file", tls.cert_file, chain)
        if b"ENCRYPTED" in key:
            raise ConfigError(f"tls.key_file: {tls.key_file} is encrypted; gRPC needs an unencrypted key")
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file, password=_no_password)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(
                f"tls.key_file: {tls.key_file} cannot be served with {tls.cert_file}: {exc}"
            ) from None
        if tls.read()[:2] != (chain, key):
            raise ConfigError(
                f"tls.cert_file, tls.key_file: {tls.cert_file} or {tls.key_file} changed while being read; "
                "reload again once both are written"
            )
        if client_ca is not None:
            _check_certificates(context, "tls.client_ca_file", tls.client_ca_file, client_ca)
        return cls(chain, key, client_ca)

    @property
    def mutual(self) -> bool:
        return self.client_ca is not None

    def export(self) -> dict[str, str | None]:
        """JSON-ready, for the daemon's private socket to a front process."""
        ca = self.client_ca.decode(_TEXT) if self.client_ca is not None else None
        return {"chain": self.chain.decode(_TEXT), "key": self.key.decode(_TEXT), "client_ca": ca}

    @classmethod
    def load(cls, raw: dict[str, str | None]) -> TlsMaterial:
        chain, key, ca = raw["chain"], raw["key"], raw["client_ca"]
        if chain is None or key is None:
            raise ValueError("TLS settings without a certificate or key")
        return cls(chain.encode(_TEXT), key.encode(_TEXT), ca.encode(_TEXT) if ca is not None else None)

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self.key, self.chain)], root_certificates=self.client_ca
        )


def check_replacement(old: TlsMaterial | None, new: TlsMaterial | None) -> None:
    """What SIGHUP cannot change: TLS on or off, and client certificates required or not, are fixed when
    the port opens. ConfigError says so, and the reload changes nothing."""
    if (old is None) != (new is None):
        raise ConfigError("tls: turning TLS on or off takes a restart (mpsd serve), not a reload")
    if old is not None and new is not None and old.mutual != new.mutual:
        raise ConfigError(
            "tls.client_ca_file: requiring client certificates or not takes a restart, not a reload"
        )


class Certificates:
    """The current TLS material of one listening port; `replace` takes effect at the next handshake."""

    def __init__(self, material: TlsMaterial) -> None:
        self.material = material
        self._pending: TlsMaterial | None = None
        self._lock = threading.Lock()  # gRPC calls `_fetch` from its own threads

    def replace(self, material: TlsMaterial) -> None:
        check_replacement(self.material, material)
        with self._lock:
            self.material = self._pending = material

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each handshake: a new certificate, or None to keep the one it has."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending.configuration() if pending is not None else None

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self.material.configuration(),
            self._fetch,
            require_client_authentication=self.material.mutual,
        )


def server_context(material: TlsMaterial) -> ssl.SSLContext:
    """An ssl module server context serving `material` (client certificates required when it is mutual).

    OpenSSL reads a key only from a file: the bytes go to one in a private temporary directory (mode 0700,
    the file 0600), removed at once, so the context serves exactly the bytes gRPC serves.
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory(prefix="mpsd-tls-") as directory:
        path = os.path.join(directory, "server.pem")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as file:
            file.write(material.chain.rstrip(b"\n") + b"\n" + material.key)
        context.load_cert_chain(path, password=_no_password)
    if material.client_ca is not None:
        context.load_verify_locations(cadata=material.client_ca.decode(_TEXT))
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class SslContexts:
    """The TLS setup of an HTTP port: `context` listens, and at each handshake hands the connection to the
    context of the current material, which `replace` changes (SIGHUP)."""

    def __init__(self, material: TlsMaterial) -> None:
        self.material = material
        self.context = server_context(material)
        self._current = self.context
        self.context.sni_callback = self._choose  # called at every handshake, with a server name or not

    def _choose(self, connection: ssl.SSLObject, server_name: str | None, context: ssl.SSLContext) -> None:
        if self._current is not context:
            connection.context = self._current

    def replace(self, material: TlsMaterial) -> None:
        check_replacement(self.material, material)
        self._current = server_context(material)
        self.material = material
