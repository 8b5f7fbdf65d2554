"""launchd job definition: where the plist and logs go, and what the plist says.

Pure functions only (no launchctl calls), so the rendered plist can be checked anywhere. Key-by-key
reasons are in launchd/README.md; `launchd/io.mpsd.daemon.plist.in` is this renderer's output with
placeholders and is kept identical to it by the tests.
"""

from __future__ import annotations

import plistlib
from pathlib import Path

from mpsd import osfacts
from mpsd.service.spec import Scope, ServiceSpec, Target

# launchd's own default PATH is /usr/bin:/bin:/usr/sbin:/sbin; Homebrew tools are common dependencies.
BASE_PATH = "/opt/homebrew/bin:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"
DEFAULT_SERVICE_USER = "_mpsd"
SYSTEM_PLIST_DIR = Path("/Library/LaunchDaemons")
SYSTEM_LOG_DIR = Path("/Library/Logs/mpsd")


def plist_path(target: Target) -> Path:
    """`<Label>.plist` in the directory launchd reads for the scope."""
    user_dir = target.home / "Library" / "LaunchAgents"
    directory = SYSTEM_PLIST_DIR if target.scope is Scope.SYSTEM else user_dir
    return directory / f"{target.label}.plist"


def log_dir(target: Target) -> Path:
    return SYSTEM_LOG_DIR if target.scope is Scope.SYSTEM else target.home / "Library" / "Logs" / "mpsd"


def log_paths(target: Target) -> tuple[Path, Path]:
    """(stdout, stderr) files; named after the label so two installed instances never share a file."""
    directory = log_dir(target)
    return directory / f"{target.label}.out.log", directory / f"{target.label}.err.log"


def plist_dict(spec: ServiceSpec, target: Target, *, session_type: str | None = None) -> dict[str, object]:
    """The job as a dict; `session_type="Background"` makes an agent loadable into `user/<uid>`."""
    stdout_path, stderr_path = log_paths(target)
    job: dict[str, object] = {
        "Label": target.label,
        # launchd restarts a job whatever its exit status: on a configuration error the daemon waits for
        # a fix instead of exiting 78 every ThrottleInterval (docs/service.md).
        "ProgramArguments": [*spec.program_arguments, "--on-config-error", "wait"],
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},
        "ThrottleInterval": int(spec.throttle_s),
        "ExitTimeOut": spec.exit_timeout_s,
        "ProcessType": "Interactive",
        "WorkingDirectory": spec.working_dir,
        "StandardOutPath": str(stdout_path),
        "StandardErrorPath": str(stderr_path),
        "EnvironmentVariables": dict(spec.environment),
    }
    if spec.open_files > 0:
        # launchd starts jobs with 256 open files; the daemon raises its own limit too, and macOS refuses
        # more than OPEN_MAX.
        files = {"NumberOfFiles": min(spec.open_files, osfacts.DARWIN.nofile_ceiling or spec.open_files)}
        job["SoftResourceLimits"] = files
        job["HardResourceLimits"] = dict(files)
    if target.scope is Scope.SYSTEM:
        if spec.service_user is None:
            raise ValueError("a system job needs a service user")
        job["UserName"] = spec.service_user
    elif session_type is not None:
        job["LimitLoadToSessionType"] = session_type
    return job


def render_plist(spec: ServiceSpec, target: Target, *, session_type: str | None = None) -> bytes:
    """XML plist in key order of the dict above (readable; launchd does not care about order)."""
    return plistlib.dumps(
        plist_dict(spec, target, session_type=session_type), fmt=plistlib.FMT_XML, sort_keys=False
    )


CONFIG_ERROR = "mpsd: configuration error: "


def pending_config_error(stderr_log: Path, tail_bytes: int = 65536) -> str | None:
    """The configuration error a daemon started with `--on-config-error wait` is waiting on, read from the
    end of its stderr log: the last such error, unless anything but its own `mpsd:` lines came after it
    (the daemon started, or a later run got further)."""
    try:
        with stderr_log.open("rb") as log:
            log.seek(max(0, log.seek(0, 2) - tail_bytes))
            lines = log.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    pending = None
    for line in lines:
        if line.startswith(CONFIG_ERROR):
            pending = line[len(CONFIG_ERROR) :]
        elif line.strip() and not line.startswith("mpsd: waiting for a fix"):
            pending = None
    return pending
