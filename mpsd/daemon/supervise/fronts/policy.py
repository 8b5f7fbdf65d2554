"""Whether fronts can run, how many and where: checked before anything starts, so a bad setting stops the
start."""

from __future__ import annotations

import errno
import socket
import sys
from dataclasses import dataclass
from typing import Any

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.errors import ConfigError
from mpsd.net.listen import DISABLED, ON_HTTP, Address, parse_address, same_port

# `auto`'s fronts: one per 2 CPUs, at most this many. A front's gRPC costs about what a bare grpc.aio
# server's does per request (550-600 us of CPU on the H200 host), and each is one core at most: four
# held ResNet-50 at 256 clients to about 7,000 requests/s, at 94% busy each.
MAX_AUTO_FRONTS = 8


def busy_poll_us(config: DaemonConfig, fronts: int) -> int:
    """How long the daemon's and its fronts' loops poll before they sleep (`net/busy_poll.py`): as
    configured, but none by default where fronts run. The daemon then reads a few links, many requests at
    a time, and on the H200 host polling bought no throughput at 64 or 256 clients while it cost the daemon
    about 50 us of CPU per request (110 against 160 us, `bench/results/busy-poll-fronts-h200*`)."""
    if fronts == 0 or "busy_poll_us" in config.model_fields_set:
        return config.busy_poll_us
    return 0


@dataclass(frozen=True)
class FrontPlan:
    """The fronts to run: `shared` on grpc_address's port (SO_REUSEPORT), or one on each of `ports`."""

    shared: int
    ports: tuple[int, ...]

    @property
    def count(self) -> int:
        return self.shared + len(self.ports)


def front_plan(config: DaemonConfig, cpu_count: int | None = None, platform: str = sys.platform) -> FrontPlan:
    """The fronts `config` asks for; ConfigError when they cannot work with its addresses."""
    ports = own_ports(config)
    return FrontPlan(0 if ports else front_count(config, cpu_count, platform), ports)


def front_count(config: DaemonConfig, cpu_count: int | None = None, platform: str = sys.platform) -> int:
    """How many front processes to run; ConfigError when the setting cannot work with the address.
    `auto` counts the CPUs the daemon may use (`osfacts.usable_cpus`), so a daemon pinned to a few cores of a
    machine runs as few fronts as a small machine would."""
    wanted = config.front_processes
    address = parse_address(config.grpc_address)
    if config.front_ports and wanted == "auto":
        return 0  # fronts on ports of their own instead (`own_ports`)
    if wanted == "auto":
        cpus = cpu_count if cpu_count is not None else osfacts.usable_cpus()
        if not platform.startswith("linux") or address.unix_path is not None or cpus <= 4:
            return 0
        return min(MAX_AUTO_FRONTS, cpus // 2)
    if wanted == 0:
        return 0
    where = f"front_processes: {wanted}"
    if config.front_ports:
        raise ConfigError(
            f"{where} and front_ports: {config.front_ports}: fronts either share grpc_address's port or "
            "listen on ports of their own; set only one of the two"
        )
    if not platform.startswith("linux"):
        raise ConfigError(
            f"{where}: front processes share the port through SO_REUSEPORT, which spreads connections "
            "only on Linux; use 0 (the daemon serves gRPC itself), or front_ports (a port per front, "
            "for clients that balance over them)"
        )
    if address.unix_path is not None:
        raise ConfigError(f"{where}: a Unix socket cannot be shared by several processes; use a TCP address")
    if address.port == 0:
        raise ConfigError(f"{where}: front processes need a fixed port, not 0")
    return wanted


def own_ports(config: DaemonConfig) -> tuple[int, ...]:
    """The ports of fronts that listen alone (`front_ports`), on any platform: no port is shared, so no
    SO_REUSEPORT is needed. ConfigError for a port another setting or another front already names."""
    ports = tuple(config.front_ports)
    if not ports:
        return ()
    where = f"front_ports: {list(ports)}"
    if config.front_processes not in (0, "auto"):
        front_count(config)  # says why both cannot be set
    address = parse_address(config.grpc_address)
    if address.unix_path is not None:
        raise ConfigError(
            f"{where}: fronts listen on grpc_address's host, and grpc_address is a Unix socket; "
            "give a TCP address"
        )
    repeated = sorted({port for port in ports if ports.count(port) > 1})
    if repeated:
        raise ConfigError(f"{where}: port {repeated[0]} is listed more than once; each front needs its own")
    others = {"grpc_address": address}
    for setting in ("http_address", "metrics_address", "openai_address"):
        text = getattr(config, setting)
        if text is not None and text.strip().lower() not in (*DISABLED, ON_HTTP):
            others[setting] = parse_address(text, setting)
    for port in ports:
        mine = front_address(address, port)
        for setting, other in others.items():
            if same_port(mine, other):
                raise ConfigError(f"{where}: port {port} collides with {setting} {other.text}")
    return ports


def front_address(main: Address, port: int) -> Address:
    """Where a front of `front_ports` listens: grpc_address's host, its own port."""
    host = f"[{main.host}]" if ":" in main.host else main.host
    return Address(f"{host}:{port}", host=main.host, port=port)


def check_port_free(address: Address) -> None:
    """Fail now, with a clear message, if another server holds the port: with SO_REUSEPORT on, another
    mpsd of the same user could otherwise join the port and share its connections unnoticed. Where the
    system lets a specific address bind beside a wildcard listener on the same port (BSD, macOS), the bind
    proves nothing, so a connection to the port is tried too: one that is accepted means a server is there."""
    try:
        infos = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"grpc_address {address.text!r}: {exc.strerror}") from None
    taken = OSError(f"cannot listen on {address.text}: the port is in use")
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As the servers themselves do: connections of a previous run in TIME_WAIT do not count.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                _bind(probe, sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise taken from None
                if exc.errno != errno.EADDRNOTAVAIL:  # e.g. no IPv6 on this host: the front skips it too
                    raise
                continue
        if osfacts.current().specific_bind_beside_wildcard and _accepts(family, sockaddr):
            raise taken


def _bind(probe: socket.socket, sockaddr: Any) -> None:
    probe.bind(sockaddr)


# How long the connection that looks for a listener may take (on this host: refused or accepted at once).
CONNECT_PROBE_S = 1.0
# Where a connection to a wildcard address goes: the same host, through loopback.
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def _accepts(family: int, sockaddr: Any) -> bool:
    """Whether a server on this host accepts a connection at `sockaddr` (a refusal: none listens)."""
    target = (_LOOPBACK.get(sockaddr[0], sockaddr[0]), *sockaddr[1:])
    with socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(CONNECT_PROBE_S)
        try:
            client.connect(target)
        except OSError:
            return False
    return True
