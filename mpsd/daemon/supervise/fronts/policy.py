"""Whether fronts can run and how many: checked before anything starts, so a bad setting stops the start."""

from __future__ import annotations

import errno
import os
import socket
import sys

from mpsd.config.daemon_config import DaemonConfig
from mpsd.errors import ConfigError
from mpsd.net.listen import Address, parse_address


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity (`taskset`, systemd's `CPUAffinity=`, a container's
    cpuset), not every CPU of the machine. macOS has no affinity: all of them."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def front_count(config: DaemonConfig, cpu_count: int | None = None, platform: str = sys.platform) -> int:
    """How many front processes to run; ConfigError when the setting cannot work with the address.
    `auto` counts the CPUs the daemon may use (`usable_cpus`), so a daemon pinned to a few cores of a large
    machine runs as few fronts as a small machine would."""
    wanted = config.front_processes
    address = parse_address(config.grpc_address)
    if wanted == "auto":
        cpus = cpu_count if cpu_count is not None else usable_cpus()
        if not platform.startswith("linux") or address.unix_path is not None or cpus <= 4:
            return 0
        return min(4, cpus // 4)
    if wanted == 0:
        return 0
    where = f"front_processes: {wanted}"
    if not platform.startswith("linux"):
        raise ConfigError(
            f"{where}: front processes share the port through SO_REUSEPORT, which spreads connections "
            "only on Linux; use 0 (the daemon serves gRPC itself)"
        )
    if address.unix_path is not None:
        raise ConfigError(f"{where}: a Unix socket cannot be shared by several processes; use a TCP address")
    if address.port == 0:
        raise ConfigError(f"{where}: front processes need a fixed port, not 0")
    return wanted


def check_port_free(address: Address) -> None:
    """Fail now, with a clear message, if another server holds the port: with SO_REUSEPORT on, another
    mpsd of the same user could otherwise join the port and share its connections unnoticed."""
    try:
        infos = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"grpc_address {address.text!r}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As the servers themselves do: connections of a previous run in TIME_WAIT do not count.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(f"cannot listen on {address.text}: the port is in use") from None
                if exc.errno != errno.EADDRNOTAVAIL:  # e.g. no IPv6 on this host: the front skips it too
                    raise
