"""The sd_notify(3) datagram protocol, so systemd knows when mpsd is ready, reloading or stopping.

Without it a `Type=notify` unit cannot tell a loading daemon from a serving one, and the watchdog cannot
catch a hung main loop. Outside systemd (`NOTIFY_SOCKET` unset, e.g. under launchd) every call is a
no-op. Sending never raises and never waits: losing a status message must not take the daemon down or
stall its loop.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


def _socket_address(value: str | None) -> bytes | None:
    """`/path` or `@abstract` (Linux abstract namespace); other forms (vsock:) are not supported."""
    if not value:
        return None
    if value.startswith("/"):
        return os.fsencode(value)
    if value.startswith("@") and len(value) > 1:
        return b"\0" + os.fsencode(value[1:])
    log.debug("sd_notify: unsupported NOTIFY_SOCKET", notify_socket=value)
    return None


def _monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds: systemd compares it with its own reload request time."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class SdNotifier:
    """Sends state changes to the service manager over `$NOTIFY_SOCKET`.

    `environ` defaults to `os.environ` and is read once, at construction. Methods return whether a
    message was sent, for tests and debug logs; callers can ignore the result.
    """

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self._address = _socket_address(env.get("NOTIFY_SOCKET"))
        self._watchdog_usec = self._parse_watchdog(env)
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()

    @staticmethod
    def _parse_watchdog(env: Mapping[str, str]) -> int | None:
        """WATCHDOG_USEC applies to us only if WATCHDOG_PID is unset or names this process."""
        usec_text = env.get("WATCHDOG_USEC", "")
        pid_text = env.get("WATCHDOG_PID", "")
        if pid_text and pid_text != str(os.getpid()):
            return None
        if not usec_text.isdigit() or int(usec_text) == 0:
            return None
        return int(usec_text)

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def notify(self, *assignments: str) -> bool:
        """Send `KEY=VALUE` assignments as one datagram."""
        if self._address is None:
            return False
        payload = "\n".join(assignments).encode("utf-8")
        try:
            with self._lock:
                if self._sock is None:
                    self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                # Never wait: it is sent from the event loop, and a service manager that stops reading
                # (a full socket: EAGAIN, or ENOBUFS on macOS) must not stall the daemon with it.
                self._sock.sendto(payload, socket.MSG_DONTWAIT, self._address)
        except OSError as exc:
            log.debug("sd_notify send failed", error=str(exc), message=assignments)
            return False
        return True

    def ready(self) -> bool:
        """Startup or a reload finished: the daemon is serving."""
        return self.notify("READY=1")

    def reloading(self) -> bool:
        """A reload began; must be followed by `ready()` (required by Type=notify-reload)."""
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={_monotonic_usec()}")

    def stopping(self) -> bool:
        """Shutdown began (draining); systemd shows `deactivating` instead of a hung service."""
        return self.notify("STOPPING=1")

    def status(self, text: str) -> bool:
        """Free-form one-line status shown by `systemctl status`."""
        return self.notify("STATUS=" + " ".join(text.splitlines()))

    def watchdog(self) -> bool:
        """Heartbeat; must come more often than WatchdogSec or systemd kills and restarts us."""
        return self.notify("WATCHDOG=1")

    def watchdog_interval(self) -> float | None:
        """Seconds between heartbeats (half of WATCHDOG_USEC, as sd_watchdog_enabled(3) advises)."""
        if self._watchdog_usec is None:
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
