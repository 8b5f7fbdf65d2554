"""Drive systemd (systemctl, journalctl) for a user unit (`--user`) or a system unit."""

from __future__ import annotations

from typing import TextIO

from mpsd.service import systemd
from mpsd.service.errors import ServiceError
from mpsd.service.manager import ServiceStatus
from mpsd.service.runner import Result, Runner
from mpsd.service.spec import Scope, ServiceSpec, Target

_SHOW_PROPERTIES = "LoadState,ActiveState,SubState,MainPID,ExecMainCode,ExecMainStatus"
# ExecMainCode holds a CLD_* value from waitid(2).
_CLD_EXITED = 1
EX_CONFIG = 78  # the daemon's exit status for a configuration error (mpsd serve)


def parse_show(text: str) -> dict[str, str]:
    """`systemctl show` prints one `Key=Value` per line."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def status_from_show(text: str, where: str) -> ServiceStatus:
    fields = parse_show(text)
    load_state = fields.get("LoadState", "")
    if load_state in ("", "not-found"):
        return ServiceStatus(loaded=False, state="not installed", where=where)
    pid_text = fields.get("MainPID", "0")
    pid = int(pid_text) if pid_text.isdigit() and int(pid_text) > 0 else None
    code_text = fields.get("ExecMainCode", "0")
    status_text = fields.get("ExecMainStatus", "")
    last_exit: str | None = None
    if code_text.isdigit() and int(code_text) != 0:
        last_exit = status_text if int(code_text) == _CLD_EXITED else f"signal {status_text}"
    active = fields.get("ActiveState", "unknown")
    sub = fields.get("SubState", "")
    problem = None
    if pid is None and int(code_text or 0) == _CLD_EXITED and status_text == str(EX_CONFIG):
        # RestartPreventExitStatus: systemd keeps it down until the config is fixed and it is started again.
        problem = "the daemon exited 78 (EX_CONFIG) and is not restarted; the journal says what is wrong"
    return ServiceStatus(
        loaded=True,
        state=f"{active} ({sub})" if sub else active,
        pid=pid,
        last_exit=last_exit,
        where=where,
        problem=problem,
    )


class SystemdManager:
    """mpsd as a systemd unit, `Type=notify` so systemd knows when the daemon is really ready."""

    name = "systemd"
    base_path = systemd.BASE_PATH
    default_service_user = systemd.DEFAULT_SERVICE_USER

    def __init__(self, target: Target, runner: Runner, *, progress: TextIO) -> None:
        self.target = target
        self.runner = runner
        self.progress = progress
        self.unit_file = systemd.unit_path(target)
        self._user = ["--user"] if target.scope is Scope.USER else []

    def _systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *self._user, *args]

    def _journalctl(self, *args: str) -> list[str]:
        return ["journalctl", *self._user, "-u", self.target.unit, *args]

    def _journal_hint(self) -> str:
        return f"see `{' '.join(self._journalctl('-n', '50', '--no-pager'))}`"

    def _run(self, *args: str) -> Result:
        return self.runner.check(self.runner.run(self._systemctl(*args)), hint=self._journal_hint())

    def install(self, spec: ServiceSpec) -> None:
        assumed = Result(("systemctl", "--version"), 0, stdout=f"systemd {systemd.NOTIFY_RELOAD_SINCE}")
        version = systemd.parse_version(self.runner.probe(["systemctl", "--version"], assume=assumed).stdout)
        unit = systemd.render_unit(spec, self.target, systemd_version=version)
        self.runner.write_file(self.unit_file, unit.encode("utf-8"))
        self._run("daemon-reload")
        self._run("enable", "--now", self.target.unit)
        if self.target.scope is Scope.USER:
            note = "user services stop at logout unless lingering is on: loginctl enable-linger $USER"
            if self.runner.dry_run:
                self.runner.note(note)
            else:
                print(f"note: {note}", file=self.progress)

    def uninstall(self) -> None:
        installed = self.unit_file.exists()
        result = self.runner.run(self._systemctl("disable", "--now", self.target.unit))
        if installed:
            self.runner.check(result, hint=self._journal_hint())
        removed = self.runner.remove_file(self.unit_file)
        self._run("daemon-reload")
        if not installed and not removed:
            print(
                f"{self.target.unit} was not installed ({self.unit_file} does not exist)", file=self.progress
            )

    def start(self) -> None:
        if not self.runner.dry_run and not self.unit_file.exists():
            raise ServiceError(f"{self.target.unit} is not installed", hint="run: mpsd service install")
        self._run("start", self.target.unit)

    def stop(self) -> None:
        self._run("stop", self.target.unit)

    def restart(self) -> None:
        self._run("restart", self.target.unit)

    def status(self) -> ServiceStatus:
        result = self.runner.probe(
            self._systemctl("show", self.target.unit, f"--property={_SHOW_PROPERTIES}")
        )
        if not result.ok:
            self.runner.check(result)
        return status_from_show(result.stdout, f"{self.target.unit} ({self.unit_file})")

    def logs(self, *, lines: int, follow: bool) -> int:
        argv = self._journalctl("-n", str(lines), "--no-pager")
        if follow:
            argv.append("-f")
        return self.runner.interactive(argv)

    def describe_logs(self) -> str:
        return f"logs: `{' '.join(self._journalctl())}` (or `mpsd service logs -f`)"
