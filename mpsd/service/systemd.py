"""systemd unit definition: where the unit goes and what it says. Pure functions, no systemctl calls.

Reload strategy: with systemd >= 253 the unit is `Type=notify-reload`: systemd sends SIGHUP itself and
waits for the daemon's `RELOADING=1` (with `MONOTONIC_USEC`) ... `READY=1`, so `systemctl reload`
returns only when the reload is done. Older systemd does not know that type; there the unit is
`Type=notify` with `ExecReload=/bin/kill -HUP $MAINPID`. The daemon behaves the same in both cases, but
on old systemd the reload job can finish before the daemon has sent `RELOADING=1`.
"""

from __future__ import annotations

import re
from pathlib import Path

from mpsd.service.spec import Scope, ServiceSpec, Target

BASE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_SERVICE_USER = "mpsd"
SYSTEM_UNIT_DIR = Path("/etc/systemd/system")
NOTIFY_RELOAD_SINCE = 253

_BARE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")


def unit_path(target: Target) -> Path:
    if target.scope is Scope.SYSTEM:
        return SYSTEM_UNIT_DIR / target.unit
    return target.home / ".config" / "systemd" / "user" / target.unit


def parse_version(text: str) -> int | None:
    """`systemctl --version` starts with e.g. "systemd 252 (252.39-1~deb12u1)"."""
    match = re.match(r"\s*systemd\s+(\d+)", text)
    return int(match.group(1)) if match else None


def _specifiers(value: str) -> str:
    """`%` starts a unit specifier (%h, %u, ...); a literal one must be doubled."""
    return value.replace("%", "%%")


def _exec_word(arg: str, *, program: bool = False) -> str:
    """One ExecStart= word: specifiers and `$VAR` expansion escaped, quoted when needed.

    systemd expands `$VAR` only in arguments, never in the program path, so `$` stays as is there.
    """
    escaped = _specifiers(arg) if program else _specifiers(arg).replace("$", "$$")
    if _BARE_WORD.fullmatch(escaped):
        return escaped
    return '"' + escaped.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _environment_line(name: str, value: str) -> str:
    quoted = _specifiers(f"{name}={value}").replace("\\", "\\\\").replace('"', '\\"')
    return f'Environment="{quoted}"'


def render_unit(spec: ServiceSpec, target: Target, *, systemd_version: int | None = None) -> str:
    """The unit file text; `systemd_version` None means unknown and selects the portable reload."""
    notify_reload = systemd_version is not None and systemd_version >= NOTIFY_RELOAD_SINCE
    program, *arguments = spec.program_arguments
    exec_start = " ".join([_exec_word(program, program=True), *(_exec_word(arg) for arg in arguments)])
    lines = [
        "# mpsd as a systemd service, written by `mpsd service install`; see docs/service.md.",
        "[Unit]",
        "Description=mpsd model server (Triton gRPC protocol)",
    ]
    if target.scope is Scope.SYSTEM:
        # The user manager has no network-online.target; only system units can order after it.
        lines += ["Wants=network-online.target", "After=network-online.target"]
    lines += ["", "[Service]"]
    if notify_reload:
        lines += ["Type=notify-reload", "ReloadSignal=SIGHUP"]
    else:
        lines += [
            "# systemd < 253 has no Type=notify-reload; the daemon still answers SIGHUP with",
            "# RELOADING=1 ... READY=1, but this reload job does not wait for it.",
            "Type=notify",
            "ExecReload=/bin/kill -HUP $MAINPID",
        ]
    lines += [
        "NotifyAccess=main",
        f"ExecStart={exec_start}",
        f"WorkingDirectory={_specifiers(spec.working_dir)}",
        *(_environment_line(name, value) for name, value in spec.environment.items()),
        "Restart=on-failure",
        "# 78 (EX_CONFIG): a configuration error; starting again would fail the same way.",
        "RestartPreventExitStatus=78",
        f"RestartSec={int(spec.throttle_s)}",
        f"TimeoutStartSec={int(spec.start_timeout_s)}",
        "# SIGTERM to the daemon only; it drains, then stops its workers. SIGKILL for all after the timeout.",
        "KillMode=mixed",
        f"TimeoutStopSec={spec.exit_timeout_s}",
    ]
    if spec.open_files > 0:  # the daemon's `open_files`: soft and hard (systemd's soft default is 1024)
        lines.append(f"LimitNOFILE={spec.open_files}")
    if spec.watchdog_s > 0:
        lines.append(f"WatchdogSec={int(spec.watchdog_s)}")
    if target.scope is Scope.SYSTEM:
        if spec.service_user is None:
            raise ValueError("a system unit needs a service user")
        lines.append(f"User={spec.service_user}")
    wanted_by = "multi-user.target" if target.scope is Scope.SYSTEM else "default.target"
    lines += ["", "[Install]", f"WantedBy={wanted_by}", ""]
    return "\n".join(lines)
