"""Drive launchd with the modern launchctl verbs (bootstrap, bootout, enable, kickstart, print).

The legacy `load`/`unload` verbs guess the domain from the caller's session; the modern ones name it, so
the same code works from a GUI terminal, over SSH (user/<uid>) and as root (system).
"""

from __future__ import annotations

import dataclasses
import plistlib
import time
from typing import TextIO

from mpsd.service import launchd
from mpsd.service.errors import ServiceError
from mpsd.service.manager import ServiceStatus
from mpsd.service.runner import Result, Runner
from mpsd.service.spec import Scope, ServiceSpec, Target

BOOTSTRAP_ATTEMPTS = 3
RETRY_BACKOFF_S = 0.5
UNLOAD_POLL_S = 0.2
UNLOAD_TIMEOUT_S = 120.0
_NOT_LOADED = Result(("launchctl", "print"), 113, stderr="Could not find service")


def parse_print(text: str) -> dict[str, str]:
    """Top-level `key = value` lines of `launchctl print <service>`.

    Apple documents this output as "not API", so only the outermost block is read and anything
    unexpected is ignored rather than treated as an error.
    """
    fields: dict[str, str] = {}
    depth = 0
    for raw in text.splitlines():
        line = raw.strip()
        if line == "}":
            depth = max(0, depth - 1)
        elif line.endswith("{"):
            depth += 1
        elif depth == 1 and " = " in line:
            key, _, value = line.partition(" = ")
            fields.setdefault(key.strip(), value.strip())
    return fields


def status_from_print(text: str, where: str) -> ServiceStatus:
    fields = parse_print(text)
    pid_text = fields.get("pid", "")
    last_exit = fields.get("last exit code")
    signal = fields.get("last terminating signal")
    if signal is not None:
        last_exit = f"{last_exit} ({signal})" if last_exit is not None else signal
    return ServiceStatus(
        loaded=True,
        state=fields.get("state", "unknown"),
        pid=int(pid_text) if pid_text.isdigit() else None,
        last_exit=last_exit,
        where=where,
    )


def _is_io_error(result: Result) -> bool:
    """launchctl's error 5: the label is still loaded or still shutting down."""
    return result.returncode == 5 or "Input/output error" in result.output


class LaunchdManager:
    """mpsd as a LaunchAgent (`gui/<uid>` or `user/<uid>`) or LaunchDaemon (`system`)."""

    name = "launchd"
    base_path = launchd.BASE_PATH
    default_service_user = launchd.DEFAULT_SERVICE_USER

    def __init__(self, target: Target, runner: Runner, *, progress: TextIO) -> None:
        self.target = target
        self.runner = runner
        self.progress = progress
        self.plist = launchd.plist_path(target)

    # -- domains ---------------------------------------------------------------------------------

    def _candidate_domains(self) -> list[str]:
        if self.target.scope is Scope.SYSTEM:
            return ["system"]
        return [f"gui/{self.target.uid}", f"user/{self.target.uid}"]

    def _gui_domain_exists(self) -> bool:
        """gui/<uid> exists only while the user is logged in at the screen (not over SSH)."""
        return self.runner.probe(["launchctl", "print", f"gui/{self.target.uid}"]).ok

    def _domain_for(self, session_type: str | None) -> str:
        if self.target.scope is Scope.SYSTEM:
            return "system"
        if session_type == "Background":
            return f"user/{self.target.uid}"
        return f"gui/{self.target.uid}"

    def _find_loaded(self, *, assume_loaded: bool) -> tuple[str, Result] | None:
        """The domain the label is loaded in, with its `print` output, or None."""
        for index, domain in enumerate(self._candidate_domains()):
            assume = None if assume_loaded and index == 0 else _NOT_LOADED
            result = self.runner.probe(["launchctl", "print", f"{domain}/{self.target.label}"], assume=assume)
            if result.ok:
                return domain, result
        return None

    def _installed_session_type(self) -> str | None:
        """Read back the session type the plist was written for, so start uses the same domain."""
        try:
            with self.plist.open("rb") as handle:
                job = plistlib.load(handle)
        except (OSError, plistlib.InvalidFileException, ValueError):
            return None
        value = job.get("LimitLoadToSessionType") if isinstance(job, dict) else None
        return value if isinstance(value, str) else None

    # -- primitives ------------------------------------------------------------------------------

    def _wait_unloaded(self, service: str) -> None:
        """bootout can return before the job is gone; poll `print` until launchd forgets the label."""
        if self.runner.dry_run:
            self.runner.note(f"wait until `launchctl print {service}` fails (the job has exited)")
            return
        deadline = time.monotonic() + UNLOAD_TIMEOUT_S
        while self.runner.probe(["launchctl", "print", service]).ok:
            if time.monotonic() > deadline:
                raise ServiceError(
                    f"{service} is still loaded {UNLOAD_TIMEOUT_S:g} s after bootout",
                    hint=f"inspect it with `launchctl print {service}`; it may be stuck shutting down",
                )
            time.sleep(UNLOAD_POLL_S)

    def _bootout(self, domain: str) -> None:
        service = f"{domain}/{self.target.label}"
        # Errors are expected here (not loaded, or already stopping); the wait below is what counts.
        self.runner.run(["launchctl", "bootout", service])
        self._wait_unloaded(service)

    def _bootstrap(self, domain: str) -> None:
        """enable + bootstrap, retrying "Bootstrap failed: 5" after a bootout (bounded)."""
        service = f"{domain}/{self.target.label}"
        # Enable first: a label left disabled (launchctl disable, or an old `unload -w`) refuses bootstrap.
        self.runner.check(self.runner.run(["launchctl", "enable", service]))
        for attempt in range(1, BOOTSTRAP_ATTEMPTS + 1):
            result = self.runner.run(["launchctl", "bootstrap", domain, str(self.plist)])
            if result.ok:
                return
            if not _is_io_error(result) or attempt == BOOTSTRAP_ATTEMPTS:
                self.runner.check(result, hint=self._bootstrap_hint(result, service))
            print(
                f"launchctl bootstrap reported an I/O error (label still loaded or stopping); "
                f"booting out {service} and retrying ({attempt + 1}/{BOOTSTRAP_ATTEMPTS})",
                file=self.progress,
                flush=True,
            )
            self._bootout(domain)
            time.sleep(RETRY_BACKOFF_S * attempt)

    def _bootstrap_hint(self, result: Result, service: str) -> str:
        if result.returncode == 125 or "Domain does not support" in result.output:
            return "no GUI login session for this user: reinstall from this shell, or use --system"
        return (
            f"check `launchctl print {service}`, `plutil -lint {self.plist}`, and that the plist is owned "
            "by its user (root for --system) and not group/world writable; see docs/service.md"
        )

    # -- commands --------------------------------------------------------------------------------

    def install(self, spec: ServiceSpec) -> None:
        session_type: str | None = None
        if self.target.scope is Scope.USER and not self._gui_domain_exists():
            session_type = "Background"
            print(
                f"no GUI session for uid {self.target.uid}: installing into user/{self.target.uid}",
                file=self.progress,
            )
        domain = self._domain_for(session_type)
        self.runner.make_dir(launchd.log_dir(self.target))
        self.runner.write_file(self.plist, launchd.render_plist(spec, self.target, session_type=session_type))
        loaded = self._find_loaded(assume_loaded=False)
        if loaded is not None:
            self._bootout(loaded[0])
        self._bootstrap(domain)

    def uninstall(self) -> None:
        loaded = self._find_loaded(assume_loaded=True)
        if loaded is not None:
            self._bootout(loaded[0])
        if not self.runner.remove_file(self.plist) and loaded is None:
            print(f"{self.target.label} was not installed ({self.plist} does not exist)", file=self.progress)

    def start(self) -> None:
        loaded = self._find_loaded(assume_loaded=False)
        if loaded is not None:
            self.runner.check(self.runner.run(["launchctl", "kickstart", f"{loaded[0]}/{self.target.label}"]))
            return
        if not self.runner.dry_run and not self.plist.exists():
            raise ServiceError(f"{self.target.label} is not installed", hint="run: mpsd service install")
        self._bootstrap(self._domain_for(self._installed_session_type()))

    def stop(self) -> None:
        loaded = self._find_loaded(assume_loaded=True)
        if loaded is None:
            print(f"{self.target.label} is not loaded", file=self.progress)
            return
        self._bootout(loaded[0])

    def restart(self) -> None:
        loaded = self._find_loaded(assume_loaded=True)
        if loaded is None:
            self.start()
            return
        service = f"{loaded[0]}/{self.target.label}"
        self.runner.check(self.runner.run(["launchctl", "kickstart", "-k", service]))

    def status(self) -> ServiceStatus:
        loaded = self._find_loaded(assume_loaded=True)
        if loaded is None:
            state = "not loaded" if self.plist.exists() else "not installed"
            return ServiceStatus(loaded=False, state=state, where=str(self.plist))
        domain, result = loaded
        status = status_from_print(result.stdout, f"{domain}/{self.target.label} ({self.plist})")
        if not status.running:
            return status
        problem = launchd.pending_config_error(launchd.log_paths(self.target)[1])
        if problem is None:
            return status
        return dataclasses.replace(
            status, problem=f"{problem} (the daemon waits for the config file to be fixed)"
        )

    def logs(self, *, lines: int, follow: bool) -> int:
        stdout_path, stderr_path = launchd.log_paths(self.target)
        paths = [stderr_path, stdout_path]
        if not follow and not self.runner.dry_run:
            paths = [p for p in paths if p.exists()]
            if not paths:
                raise ServiceError(
                    f"no log files yet in {launchd.log_dir(self.target)}",
                    hint="is the service installed and started? see `mpsd service status`",
                )
        argv = ["tail", "-n", str(lines)] + (["-F"] if follow else []) + [str(p) for p in paths]
        return self.runner.interactive(argv)

    def describe_logs(self) -> str:
        stdout_path, stderr_path = launchd.log_paths(self.target)
        return f"logs: {stderr_path} (stderr), {stdout_path} (stdout); follow with `mpsd service logs -f`"
