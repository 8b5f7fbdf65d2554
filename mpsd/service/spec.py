"""What to install (`ServiceSpec`) and where (`Target`), independent of the service manager.

Both launchd and systemd render from the same two values, so the two backends cannot drift apart on
the command line, the environment or the stop timeout.
"""

from __future__ import annotations

import enum
import math
import os
import pwd
import re
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml

from mpsd.config.daemon_config import DEFAULT_OPEN_FILES
from mpsd.service.errors import ServiceError

DEFAULT_LABEL = "io.mpsd.daemon"
DEFAULT_UNIT = "mpsd.service"
DEFAULT_ADDRESS = "127.0.0.1:8001"
DEFAULT_CONFIG = "config/mpsd.yaml"
DEFAULT_DRAIN_TIMEOUT_S = 30.0
DEFAULT_SHUTDOWN_GRACE_S = 5.0  # the daemon's shutdown_grace_s default
DEFAULT_THROTTLE_S = 10
DEFAULT_WATCHDOG_S = 30
DEFAULT_START_TIMEOUT_S = 300
# Seconds the service manager waits beyond the drain timeout before SIGKILL: the daemon still has to stop
# its workers and release GPU memory after the last request has drained.
STOP_MARGIN_S = 30

_LABEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_UNIT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9:_.@-]*\.service")
_ENV_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ACCOUNT_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*")


class Scope(enum.Enum):
    """Per-user service (no root, runs while the user's session exists) or system-wide (root, at boot)."""

    USER = "user"
    SYSTEM = "system"


@dataclass(frozen=True)
class Target:
    """Which installed service a command acts on; enough for start/stop/status without the config."""

    scope: Scope
    home: Path
    uid: int
    label: str = DEFAULT_LABEL
    unit: str = DEFAULT_UNIT


@dataclass(frozen=True)
class ServiceSpec:
    """Everything a plist or unit says about how to run the daemon. All paths are absolute."""

    python: str
    config: str
    working_dir: str
    environment: Mapping[str, str]
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    throttle_s: int = DEFAULT_THROTTLE_S
    watchdog_s: int = DEFAULT_WATCHDOG_S
    start_timeout_s: int = DEFAULT_START_TIMEOUT_S
    service_user: str | None = None
    # The daemon's `open_files`, which the service manager starts it with too; 0: the manager's own limits.
    open_files: int = DEFAULT_OPEN_FILES

    @property
    def program_arguments(self) -> list[str]:
        """The daemon's argv; the interpreter path is kept as given so a venv stays a venv."""
        return [self.python, "-m", "mpsd", "serve", "--config", self.config]

    @property
    def exit_timeout_s(self) -> int:
        """SIGTERM-to-SIGKILL grace: longer than the daemon's shutdown grace (still serving, health saying
        NOT_SERVING) and its drain together, so in-flight requests are never cut off."""
        return math.ceil(self.shutdown_grace_s + self.drain_timeout_s) + STOP_MARGIN_S


def make_target(
    scope: Scope,
    *,
    label: str = DEFAULT_LABEL,
    unit: str = DEFAULT_UNIT,
    home: Path | None = None,
    uid: int | None = None,
) -> Target:
    """Validate names early: a bad label otherwise surfaces as an obscure launchctl error."""
    if not _LABEL_RE.fullmatch(label):
        raise ServiceError(
            f"invalid label {label!r}", hint="use reverse-DNS style letters, digits, '.', '-', '_'"
        )
    if not unit.endswith(".service"):
        unit += ".service"
    if not _UNIT_RE.fullmatch(unit):
        raise ServiceError(f"invalid unit name {unit!r}", hint="for example: mpsd.service")
    return Target(
        scope=scope,
        home=home if home is not None else Path.home(),
        uid=uid if uid is not None else os.getuid(),
        label=label,
        unit=unit,
    )


def check_privileges(scope: Scope, euid: int) -> None:
    """Refuse system scope for non-root callers up front instead of failing half-way through."""
    if scope is Scope.SYSTEM and euid != 0:
        raise ServiceError(
            f"--system needs root (running as uid {euid})",
            hint="re-run with sudo, or install for the current user with --user",
        )


def parse_env_assignments(items: list[str]) -> dict[str, str]:
    """`KEY=VALUE` pairs from the command line, validated so they cannot break a plist or unit."""
    env: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not _ENV_NAME_RE.fullmatch(name):
            raise ServiceError(
                f"invalid environment setting {item!r}",
                hint="use --env NAME=VALUE, for example --env PYTORCH_ENABLE_MPS_FALLBACK=1",
            )
        env[name] = value
    return env


def _config_mapping(config: Path) -> dict[str, object]:
    try:
        data = yaml.safe_load(config.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def drain_timeout_from_config(config: Path) -> float | None:
    """Read only `drain_timeout_s` from the daemon config: ExitTimeOut must exceed it."""
    value = _config_mapping(config).get("drain_timeout_s")
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


def shutdown_grace_from_config(config: Path) -> float | None:
    """Read only `shutdown_grace_s` from the daemon config: ExitTimeOut must exceed it and the drain."""
    value = _config_mapping(config).get("shutdown_grace_s")
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        return None
    return float(value)


def open_files_from_config(config: Path) -> int | None:
    """Read only `open_files` from the daemon config: the service's limit is the one the daemon asks for."""
    value = _config_mapping(config).get("open_files")
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def health_address_from_config(config: Path) -> str | None:
    """`grpc_address` from the daemon config, with a wildcard host replaced by loopback for polling."""
    value = _config_mapping(config).get("grpc_address")
    if not isinstance(value, str) or ":" not in value:
        return None
    host, _, port = value.rpartition(":")
    if host in ("", "0.0.0.0", "[::]", "::"):
        host = "127.0.0.1"
    return f"{host}:{port}"


def service_account_home(name: str) -> str:
    """The service account's home, which becomes HOME for a system service (torch caches live there)."""
    if not _ACCOUNT_RE.fullmatch(name):
        raise ServiceError(f"invalid account name {name!r}")
    try:
        return pwd.getpwnam(name).pw_dir
    except KeyError:
        raise ServiceError(
            f"service account {name!r} does not exist",
            hint="create it first (see 'Service account' in docs/service.md) or pass --service-user",
        ) from None


def make_spec(
    target: Target,
    *,
    config: str | os.PathLike[str],
    base_path: str,
    python: str | None = None,
    drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S,
    throttle_s: int = DEFAULT_THROTTLE_S,
    watchdog_s: int = DEFAULT_WATCHDOG_S,
    start_timeout_s: int = DEFAULT_START_TIMEOUT_S,
    environment: Mapping[str, str] | None = None,
    working_dir: str | os.PathLike[str] | None = None,
    service_user: str | None = None,
    service_home: str | None = None,
    open_files: int | None = None,
) -> ServiceSpec:
    """Resolve every default to an absolute, validated value; `base_path` is the manager's PATH tail.
    `open_files` None: the config's (`open_files`), else the daemon's default."""
    interpreter = os.path.abspath(python if python is not None else sys.executable)
    config_path = Path(config).expanduser().resolve()
    if not config_path.is_file():
        raise ServiceError(
            f"config file not found: {config_path}", hint="pass --config /absolute/path/to/mpsd.yaml"
        )
    workdir = Path(working_dir).expanduser().resolve() if working_dir is not None else config_path.parent
    if drain_timeout_s < 0:
        raise ServiceError(f"drain timeout must not be negative (got {drain_timeout_s:g})")
    if target.scope is Scope.SYSTEM:
        if service_user is None:
            raise ServiceError("a system service needs a service account", hint="pass --service-user NAME")
        home = service_home if service_home is not None else service_account_home(service_user)
    else:
        service_user = None
        home = str(target.home)
    env = {"PATH": f"{os.path.dirname(interpreter)}:{base_path}", "HOME": home}
    env.update(environment or {})
    if open_files is None:
        open_files = open_files_from_config(config_path)
    spec = ServiceSpec(
        python=interpreter,
        config=str(config_path),
        working_dir=str(workdir),
        environment=env,
        drain_timeout_s=drain_timeout_s,
        shutdown_grace_s=shutdown_grace_s,
        throttle_s=throttle_s,
        watchdog_s=watchdog_s,
        start_timeout_s=start_timeout_s,
        service_user=service_user,
        open_files=DEFAULT_OPEN_FILES if open_files is None else open_files,
    )
    _reject_control_characters(spec)
    return spec


def _reject_control_characters(spec: ServiceSpec) -> None:
    """A newline in a value would inject lines into a unit file; refuse rather than escape."""
    values = [spec.python, spec.config, spec.working_dir, *spec.environment.values()]
    for value in values:
        if any(ord(ch) < 0x20 for ch in value):
            raise ServiceError(f"control character in {value!r}", hint="paths and values must be one line")
