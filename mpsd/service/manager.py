"""The interface both backends implement, and the choice between them.

The CLI only talks to `ServiceManager`; launchd- and systemd-specific knowledge stays in their modules.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Protocol

from mpsd.service.errors import ServiceError
from mpsd.service.spec import ServiceSpec

MANAGERS = ("launchd", "systemd")


@dataclass(frozen=True)
class ServiceStatus:
    """What the service manager reports, reduced to what an operator asks first."""

    loaded: bool
    state: str
    pid: int | None = None
    last_exit: str | None = None
    where: str = ""
    problem: str | None = None  # what keeps a running daemon from serving (a configuration error it waits on)

    @property
    def running(self) -> bool:
        return self.loaded and self.pid is not None

    def summary(self) -> str:
        parts = [self.state]
        if self.pid is not None:
            parts.append(f"pid {self.pid}")
        if self.last_exit is not None:
            parts.append(f"last exit {self.last_exit}")
        return ", ".join(parts)


class ServiceManager(Protocol):
    """One installed mpsd service, driven through its platform's service manager."""

    name: str
    base_path: str
    default_service_user: str

    def install(self, spec: ServiceSpec) -> None: ...

    def uninstall(self) -> None: ...

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def restart(self) -> None: ...

    def status(self) -> ServiceStatus: ...

    def logs(self, *, lines: int, follow: bool) -> int: ...

    def describe_logs(self) -> str:
        """One line telling the user where the logs are."""
        ...


def default_manager(platform: str | None = None) -> str:
    """launchd on macOS, systemd on Linux; anything else must be chosen with --manager."""
    platform = sys.platform if platform is None else platform
    if platform == "darwin":
        return "launchd"
    if platform.startswith("linux"):
        return "systemd"
    raise ServiceError(
        f"no service manager support for platform {platform!r}", hint="pass --manager launchd|systemd"
    )
