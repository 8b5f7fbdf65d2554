"""Where the gRPC and HTTP servers listen: TCP host:port or a Unix socket, in the clear or over (mutual) TLS.

A Unix socket is the tightest default for a single-host daemon: its file is mode 0600, so only the
daemon's user can connect, and no network stack is involved at all.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog

from mpsd.errors import ConfigError
from mpsd.net.certificates import Certificates

log = structlog.get_logger("mpsd.net.listen")

UNIX_PREFIX = "unix:"
SOCKET_MODE = 0o600
# sockaddr_un.sun_path: 108 bytes on Linux, 104 on macOS, including the terminating NUL.
MAX_SOCKET_PATH = 103
LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost")


@dataclass(frozen=True)
class Address:
    """A parsed grpc_address: a Unix socket path, or a TCP host and port."""

    text: str
    unix_path: Path | None = None
    host: str = ""
    port: int = 0

    @property
    def grpc_target(self) -> str:
        return f"unix:{self.unix_path}" if self.unix_path is not None else self.text

    @property
    def is_local(self) -> bool:
        """Only this host can connect: a Unix socket or a loopback address."""
        if self.unix_path is not None:
            return True
        if self.host.lower() in LOOPBACK_NAMES:
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def parse_address(text: str, setting: str = "grpc_address") -> Address:
    """`host:port`, `[v6]:port` or `unix:///absolute/path` (also `unix:/absolute/path`); ConfigError
    messages name `setting`."""
    if text.startswith(UNIX_PREFIX):
        rest = text[len(UNIX_PREFIX) :]
        if rest.startswith("//"):
            rest = rest[2:]
        if not rest.startswith("/"):
            raise ConfigError(f"{setting} {text!r}: a Unix socket needs an absolute path (unix:///path)")
        path = Path(rest)
        if len(os.fsencode(path)) > MAX_SOCKET_PATH:
            raise ConfigError(
                f"{setting} {text!r}: the socket path is longer than {MAX_SOCKET_PATH} bytes, "
                "which Unix sockets cannot hold; choose a shorter path"
            )
        return Address(text, unix_path=path)
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{setting} {text!r}: expected host:port or unix:///path/to/socket")
    return Address(text, host=host.removeprefix("[").removesuffix("]"), port=int(port))


DISABLED = ("", "off")


def http_address(text: str | None) -> Address | None:
    """The HTTP address a config gives (`http_address`), None when HTTP is off; ConfigError if malformed."""
    if text is None or text.strip().lower() in DISABLED:
        return None
    return parse_address(text, "http_address")


ON_HTTP = "http"  # openai_address's default: OpenAI's API on the HTTP port, beside KServe's routes


def openai_address(text: str) -> Address | None:
    """The port of its own a config gives OpenAI's API (`openai_address`): None when it is served on the
    HTTP port or not at all; ConfigError if malformed."""
    if text.strip().lower() in (*DISABLED, ON_HTTP):
        return None
    return parse_address(text, "openai_address")


def openai_served(text: str, http: Address | None) -> bool:
    """Whether OpenAI's API is served at all: on a port of its own, or on an HTTP port that is on."""
    choice = text.strip().lower()
    return choice not in DISABLED and (choice != ON_HTTP or http is not None)


def same_port(one: Address, other: Address) -> bool:
    """Two addresses that cannot both be listened on by this process: one socket path, or one TCP port on
    overlapping hosts (a wildcard host overlaps every other)."""
    if one.unix_path is not None or other.unix_path is not None:
        return one.unix_path == other.unix_path
    wildcard = ("0.0.0.0", "::", "")
    return one.port == other.port != 0 and (
        one.host == other.host or one.host in wildcard or other.host in wildcard
    )


def remove_stale_socket(path: Path) -> None:
    """Remove a socket file left by a daemon that died; refuse a live socket or any other kind of file."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise ConfigError(f"{path} exists and is not a socket; refusing to replace it")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError as exc:
            if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise
        else:
            raise ConfigError(f"{path}: another server is listening on this socket")
    log.info("removing stale socket", path=str(path))
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def prepare_socket_path(address: Address, setting: str = "grpc_address") -> None:
    """Before binding a Unix socket: its directory exists, and a stale socket file is gone."""
    if address.unix_path is not None:
        if not address.unix_path.parent.is_dir():
            raise ConfigError(f"{setting}: directory {address.unix_path.parent} does not exist")
        remove_stale_socket(address.unix_path)


def connection_age_options(max_age_s: float, grace_s: float) -> list[tuple[str, int]]:
    """gRPC server options that end a client connection past `max_age_s` (GOAWAY: the client reconnects,
    perhaps to another host) after `grace_s` for the calls in progress on it; none when `max_age_s` is 0."""
    if max_age_s <= 0:
        return []
    return [
        ("grpc.max_connection_age_ms", max(1, round(max_age_s * 1000))),
        ("grpc.max_connection_age_grace_ms", round(grace_s * 1000)),
    ]


def bind(server: grpc.aio.Server, address: Address, certificates: Certificates | None) -> None:
    """Add the listening port (over TLS with `certificates`); for a Unix socket, make the file 0600 before
    anyone can use it."""
    prepare_socket_path(address)
    credentials = certificates.credentials() if certificates is not None else None
    # The umask covers the moment between bind() and chmod(); the chmod makes the mode independent of it.
    old_umask = os.umask(0o177) if address.unix_path is not None else None
    try:
        if credentials is not None:
            port = server.add_secure_port(address.grpc_target, credentials)
        else:
            port = server.add_insecure_port(address.grpc_target)
    finally:
        if old_umask is not None:
            os.umask(old_umask)
    if port == 0:
        raise OSError(f"cannot listen on {address.text}")
    if address.unix_path is not None:
        os.chmod(address.unix_path, SOCKET_MODE)
