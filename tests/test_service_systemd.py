"""systemd integration: the rendered unit, and the systemctl/journalctl command sequences.

No systemd instance can be driven from the test suite (it is not PID 1 here and must not be touched on a
developer machine), so the command tests put recording stand-ins for `systemctl` and `journalctl` first on
PATH. Where `systemd-analyze` is installed, the unit is also checked by systemd's own parser.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import psutil
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from mpsd.service import systemd
from mpsd.service.spec import Scope, ServiceSpec, make_spec, make_target
from mpsd.service.systemctl import status_from_show
from tests import models
from tests.conftest import free_port, wait_for
from tests.service_fakes import PROCESS_CONTROL, kill_started

REPO = Path(__file__).resolve().parents[1]
UNIT = "mpsd.service"

FAKE_TOOL = textwrap.dedent(
    """\
    #!@PYTHON@
    # Stand-in systemctl/journalctl: records argv, keeps the unit's active state in $FAKE_STATE.
    import json, os, sys
    from pathlib import Path

    state = Path(os.environ["FAKE_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    tool = os.path.basename(sys.argv[0])
    args = sys.argv[1:]
    with open(state / "calls.jsonl", "a") as log:
        log.write(json.dumps([tool] + args) + "\\n")
    active = state / "active"
    if tool == "journalctl":
        print("Nov 22 10:00:00 host mpsd[999]: serving on 127.0.0.1:8001")
        sys.exit(0)
    words = [a for a in args if a != "--user"]
    if words == ["--version"]:
        print("systemd %s (%s.1-1)" % ((os.environ.get("FAKE_SYSTEMD_VERSION", "256"),) * 2))
        print("+PAM +AUDIT +SELINUX")
        sys.exit(0)
    verb = words[0]
    if verb in os.environ.get("FAKE_FAIL", "").split(","):
        print("Job for mpsd.service failed because the control process exited with error code.",
              file=sys.stderr)
        sys.exit(1)
    if verb == "show":
        if active.exists():
            main_pid = (state / "pid").read_text() if (state / "pid").exists() else "999"
            print("LoadState=loaded\\nActiveState=active\\nSubState=running\\nMainPID=" + main_pid)
            print("ExecMainCode=0\\nExecMainStatus=0")
        else:
            print("LoadState=loaded\\nActiveState=failed\\nSubState=failed\\nMainPID=0")
            print("ExecMainCode=1\\nExecMainStatus=75")
        sys.exit(0)
    if verb in ("stop", "restart") or words[:2] == ["disable", "--now"]:
        stop_process()
    if verb in ("start", "restart") or words[:2] == ["enable", "--now"]:
        active.touch()
        if os.environ.get("FAKE_EXEC"):
            start_daemon()
    if verb == "stop" or words[:2] == ["disable", "--now"]:
        active.unlink(missing_ok=True)
    sys.exit(0)
    """
)

# With FAKE_EXEC set, the stand-in systemctl does what systemd does with the unit: it runs ExecStart=, in
# WorkingDirectory= with the Environment= lines, and stops the process with SIGTERM.
FAKE_EXEC = PROCESS_CONTROL + textwrap.dedent(
    """\
    import shlex

    def unit_directives():
        unit = Path(os.environ["HOME"]) / ".config" / "systemd" / "user" / "mpsd.service"
        found = {}
        for line in unit.read_text().splitlines():
            if line and not line.startswith(("#", "[")):
                key, _, value = line.partition("=")
                found.setdefault(key, []).append(value.replace("%%", "%"))
        return found

    def start_daemon():
        d = unit_directives()
        argv = shlex.split(d["ExecStart"][0].replace("$$", "$"))
        env = dict(shlex.split(line)[0].split("=", 1) for line in d.get("Environment", []))
        log = state / "daemon.log"
        start_process(argv, d["WorkingDirectory"][0], env, log, log)

    """
)
FAKE_TOOL = FAKE_TOOL.replace('active = state / "active"\n', FAKE_EXEC + 'active = state / "active"\n')


class Env:
    """HOME, stand-in systemctl/journalctl first on PATH, and the stand-ins' state directory."""

    def __init__(self, tmp_path: Path) -> None:
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.state = tmp_path / "state"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for name in ("systemctl", "journalctl"):
            tool = bin_dir / name
            tool.write_text(FAKE_TOOL.replace("@PYTHON@", sys.executable))
            tool.chmod(0o755)
        self.config = tmp_path / "etc" / "mpsd.yaml"
        self.config.parent.mkdir()
        self.config.write_text("drain_timeout_s: 30\n")
        (self.config.parent / "models").mkdir()  # the default model_repository, next to the config
        self.vars = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(self.home),
            "FAKE_STATE": str(self.state),
            "PYTHONPATH": str(REPO),
        }

    @property
    def unit_file(self) -> Path:
        return self.home / ".config" / "systemd" / "user" / UNIT

    def cli(self, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "NOTIFY_", "XDG_"))}
        env.update(self.vars)
        env.update(extra_env)
        return subprocess.run(
            [sys.executable, "-m", "mpsd.service", *args, "--manager", "systemd"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )

    def calls(self) -> list[list[str]]:
        log = self.state / "calls.jsonl"
        if not log.exists():
            return []
        return [json.loads(line) for line in log.read_text().splitlines()]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    made = Env(tmp_path)
    yield made
    kill_started(made.state)


@pytest.fixture
def serving_address() -> Iterator[str]:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


def _spec(tmp_path: Path, scope: Scope, **overrides: object) -> ServiceSpec:
    config = tmp_path / "cfg" / "mpsd.yaml"
    config.parent.mkdir(exist_ok=True)
    config.write_text("drain_timeout_s: 30\n")
    kwargs: dict[str, object] = {
        "config": config,
        "base_path": systemd.BASE_PATH,
        "environment": {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    }
    if scope is Scope.SYSTEM:
        kwargs.update(service_user="mpsd", service_home="/var/lib/mpsd")
    kwargs.update(overrides)
    target = make_target(scope, home=tmp_path / "home", uid=1000)
    return make_spec(target, **kwargs)  # type: ignore[arg-type]


def _directives(unit: str) -> dict[str, list[str]]:
    """Key -> values of every `Key=value` line (comments and sections skipped)."""
    found: dict[str, list[str]] = {}
    for line in unit.splitlines():
        if line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            found.setdefault(key, []).append(value)
    return found


def _systemd_verify(unit_text: str, tmp_path: Path) -> None:
    """systemd's own parser; it exits 0 even for bad lines, so its messages are what counts."""
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    unit_dir = tmp_path / "verify"
    unit_dir.mkdir(exist_ok=True)
    unit_file = unit_dir / UNIT
    unit_file.write_text(unit_text)
    proc = subprocess.run([analyze, "verify", str(unit_file)], capture_output=True, text=True, check=False)
    complaints = [
        line
        for line in (proc.stdout + proc.stderr).splitlines()
        if str(unit_file) in line or "ignoring" in line or "not executable" in line
    ]
    assert complaints == []


def _analyze_version() -> int | None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        return None
    out = subprocess.run([analyze, "--version"], capture_output=True, text=True, check=False).stdout
    return systemd.parse_version(out)


# -- the unit ----------------------------------------------------------------------------------------


def test_user_unit_has_the_required_directives(tmp_path: Path) -> None:
    unit = systemd.render_unit(
        _spec(tmp_path, Scope.USER), make_target(Scope.USER, home=tmp_path), systemd_version=256
    )
    d = _directives(unit)
    assert d["Type"] == ["notify-reload"]
    assert d["ReloadSignal"] == ["SIGHUP"]
    assert "ExecReload" not in d  # systemd itself signals and waits for RELOADING=1 ... READY=1
    assert d["NotifyAccess"] == ["main"]
    config = str((tmp_path / "cfg" / "mpsd.yaml").resolve())
    assert d["ExecStart"] == [f"{sys.executable} -m mpsd serve --config {config}"]
    assert d["Restart"] == ["on-failure"]
    assert d["RestartPreventExitStatus"] == ["78"]  # a configuration error is not retried every 10 s
    assert int(d["TimeoutStopSec"][0]) > 30
    assert int(d["WatchdogSec"][0]) > 0
    assert d["KillMode"] == ["mixed"]
    assert d["LimitNOFILE"] == ["10240"]  # the daemon's open_files, not systemd's soft 1024
    assert d["WorkingDirectory"] == [str((tmp_path / "cfg").resolve())]
    env = d["Environment"]
    assert f'"HOME={tmp_path / "home"}"' in env
    assert f'"PATH={os.path.dirname(sys.executable)}:{systemd.BASE_PATH}"' in env
    assert '"PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"' in env
    assert d["WantedBy"] == ["default.target"]
    assert "User" not in d and "After" not in d


@pytest.mark.parametrize("version", [252, None])
def test_old_or_unknown_systemd_gets_type_notify_with_exec_reload(
    tmp_path: Path, version: int | None
) -> None:
    unit = systemd.render_unit(
        _spec(tmp_path, Scope.USER), make_target(Scope.USER, home=tmp_path), systemd_version=version
    )
    d = _directives(unit)
    assert d["Type"] == ["notify"]
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["NotifyAccess"] == ["main"]


def test_system_unit_runs_as_service_account(tmp_path: Path) -> None:
    target = make_target(Scope.SYSTEM, home=tmp_path)
    d = _directives(systemd.render_unit(_spec(tmp_path, Scope.SYSTEM), target, systemd_version=256))
    assert d["User"] == ["mpsd"]
    assert d["WantedBy"] == ["multi-user.target"]
    assert d["After"] == ["network-online.target"]
    assert '"HOME=/var/lib/mpsd"' in d["Environment"]
    assert systemd.unit_path(target) == Path("/etc/systemd/system/mpsd.service")


def test_stop_timeout_follows_drain_timeout_and_watchdog_can_be_off(tmp_path: Path) -> None:
    spec = _spec(tmp_path, Scope.USER, drain_timeout_s=120.5, watchdog_s=0)
    d = _directives(systemd.render_unit(spec, make_target(Scope.USER, home=tmp_path), systemd_version=256))
    assert int(d["TimeoutStopSec"][0]) > 120.5
    assert "WatchdogSec" not in d


@pytest.mark.parametrize(("open_files", "written"), [(65536, ["65536"]), (0, None)])
def test_open_file_limit_follows_the_daemons_setting(
    tmp_path: Path, open_files: int, written: list[str] | None
) -> None:
    d = _directives(
        systemd.render_unit(
            _spec(tmp_path, Scope.USER, open_files=open_files), make_target(Scope.USER, home=tmp_path)
        )
    )
    assert d.get("LimitNOFILE") == written


def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    version = _analyze_version()
    unit = systemd.render_unit(
        _spec(tmp_path, Scope.USER), make_target(Scope.USER, home=tmp_path), systemd_version=version
    )
    _systemd_verify(unit, tmp_path)


def test_awkward_paths_are_escaped_for_systemd(tmp_path: Path) -> None:
    """Spaces, `%` (specifiers) and `$` (expanded in arguments only) survive systemd's parser."""
    odd_dir = tmp_path / "a dir 100% $HOME"
    odd_dir.mkdir()
    python = odd_dir / "python"
    python.symlink_to(sys.executable)
    config = odd_dir / "my $cfg.yaml"
    config.write_text("drain_timeout_s: 30\n")
    spec = _spec(tmp_path, Scope.USER, python=str(python), config=config, environment={"X": 'say "hi" 50%'})
    unit = systemd.render_unit(
        spec, make_target(Scope.USER, home=tmp_path), systemd_version=_analyze_version()
    )
    exec_start = _directives(unit)["ExecStart"][0]
    program = str(python).replace("%", "%%")
    assert exec_start.startswith(f'"{program}" -m mpsd serve --config ')
    assert exec_start.endswith('my $$cfg.yaml"')
    assert 'Environment="X=say \\"hi\\" 50%%"' in unit
    _systemd_verify(unit, tmp_path)  # finds the executable only if the quoting is right


def test_unit_rejects_newlines_in_values(tmp_path: Path) -> None:
    from mpsd.service.errors import ServiceError

    with pytest.raises(ServiceError):
        _spec(tmp_path, Scope.USER, environment={"X": "a\nExecStartPre=/bin/evil"})


def test_status_parsing_from_show() -> None:
    text = (
        "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\nExecMainCode=2\nExecMainStatus=9\n"
    )
    status = status_from_show(text, "here")
    assert (status.loaded, status.running, status.last_exit) == (True, False, "signal 9")
    assert not status_from_show("LoadState=not-found\n", "here").loaded


# -- commands through the CLI ------------------------------------------------------------------------


def test_install_writes_unit_reloads_enables_and_waits(env: Env, serving_address: str) -> None:
    proc = env.cli("install", "--config", str(env.config), "--address", serving_address)
    assert proc.returncode == 0, proc.stderr
    assert env.calls() == [
        ["systemctl", "--version"],
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "enable", "--now", UNIT],
    ]
    d = _directives(env.unit_file.read_text())
    assert d["Type"] == ["notify-reload"]
    assert d["ExecStart"][0].startswith(f"{sys.executable} -m mpsd serve --config ")
    assert "ready after" in proc.stderr
    assert f"journalctl --user -u {UNIT}" in proc.stdout


def test_install_refuses_a_config_the_daemon_would_refuse(env: Env) -> None:
    """The daemon would exit 78 at every start: nothing is installed, and the error says why."""
    env.config.write_text("grpc_address: unix:///tmp/mpsd-test.sock\nfront_processes: 2\n")
    proc = env.cli("install", "--config", str(env.config), "--no-wait")
    assert proc.returncode == 1
    assert "mpsd service: error: configuration error: front_processes: 2" in proc.stderr
    assert "nothing was installed" in proc.stderr
    assert not env.unit_file.exists()
    assert [c for c in env.calls() if c[1:] != ["--version"]] == []


def test_install_starts_the_units_command_line_and_waits_for_that_daemon(env: Env) -> None:
    """No stand-in server: the stand-in systemctl runs the unit's own ExecStart= (FAKE_EXEC), so install
    waits for the real daemon that command line starts, serving the config's repository."""
    repo = env.config.parent / "models"
    models.add_sub(repo)
    address = f"127.0.0.1:{free_port()}"
    env.config.write_text(f"grpc_address: '{address}'\nmetrics_address: ''\ndrain_timeout_s: 5\n")
    proc = env.cli("install", "--config", str(env.config), "--wait-timeout", "120", FAKE_EXEC="1")
    assert proc.returncode == 0, proc.stderr + (env.state / "daemon.log").read_text()
    assert f"serving on {address}" in proc.stdout
    pid = int((env.state / "pid").read_text())
    client = grpcclient.InferenceServerClient(address)
    try:
        # install waited for liveness (health ""); the model is served by that same daemon once loaded
        wait_for(lambda: client.is_model_ready("add_sub"), 120, "the installed daemon serving add_sub")
    finally:
        client.close()
    assert env.cli("status", FAKE_EXEC="1").stdout.splitlines()[0] == f"{UNIT}: active (running), pid {pid}"
    assert env.cli("stop", FAKE_EXEC="1").returncode == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_install_on_old_systemd_uses_type_notify(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait", FAKE_SYSTEMD_VERSION="252")
    assert proc.returncode == 0, proc.stderr
    d = _directives(env.unit_file.read_text())
    assert d["Type"] == ["notify"] and d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]


def test_failed_start_is_one_line_error_pointing_at_the_journal(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait", FAKE_FAIL="enable")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    error, hint = [line for line in proc.stderr.splitlines() if line.startswith(("mpsd service:", "hint:"))]
    assert error.startswith(
        "mpsd service: error: `systemctl --user enable --now mpsd.service` failed (exit 1)"
    )
    assert hint == f"hint: see `journalctl --user -u {UNIT} -n 50 --no-pager`"


def test_dry_run_prints_unit_and_commands_and_runs_nothing(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert env.calls() == []
    assert not env.unit_file.exists()
    assert f"# write {env.unit_file}" in proc.stdout
    assert "ExecStart=" in proc.stdout and "Type=notify-reload" in proc.stdout
    assert "$ systemctl --user daemon-reload" in proc.stdout
    assert f"$ systemctl --user enable --now {UNIT}" in proc.stdout


def test_stop_timeout_allows_the_shutdown_grace_and_the_drain_from_the_config(env: Env) -> None:
    """The daemon keeps serving for shutdown_grace_s after SIGTERM before its drain: SIGKILL must wait."""
    env.config.write_text("drain_timeout_s: 30\nshutdown_grace_s: 100\n")
    proc = env.cli("install", "--config", str(env.config), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    (line,) = [line for line in proc.stdout.splitlines() if line.startswith("TimeoutStopSec=")]
    assert int(line.split("=", 1)[1]) > 130


def test_install_takes_the_open_file_limit_from_the_config(env: Env) -> None:
    env.config.write_text("open_files: 32768\n")
    proc = env.cli("install", "--config", str(env.config), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "LimitNOFILE=32768" in proc.stdout.splitlines()


def test_dry_run_system_scope_uses_system_manager(env: Env) -> None:
    proc = env.cli(
        "install", "--system", "--config", str(env.config), "--dry-run", "--service-home", "/var/lib/mpsd"
    )
    assert proc.returncode == 0, proc.stderr
    assert env.calls() == []
    assert "# write /etc/systemd/system/mpsd.service" in proc.stdout
    assert "User=mpsd" in proc.stdout
    assert "$ systemctl daemon-reload" in proc.stdout
    assert f"$ systemctl enable --now {UNIT}" in proc.stdout


def test_start_stop_restart_verbs(env: Env) -> None:
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    mark = len(env.calls())
    assert env.cli("stop").returncode == 0
    assert env.cli("start", "--no-wait").returncode == 0
    assert env.cli("restart", "--no-wait").returncode == 0
    assert env.calls()[mark:] == [
        ["systemctl", "--user", "stop", UNIT],
        ["systemctl", "--user", "start", UNIT],
        ["systemctl", "--user", "restart", UNIT],
    ]


def test_status_running_and_failed(env: Env) -> None:
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    proc = env.cli("status")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[0] == f"{UNIT}: active (running), pid 999"
    assert env.cli("stop").returncode == 0
    proc = env.cli("status")
    assert proc.returncode == 3
    assert proc.stdout.splitlines()[0] == f"{UNIT}: failed (failed), last exit 75"
    assert env.calls()[-1][:4] == ["systemctl", "--user", "show", UNIT]


def test_logs_use_journalctl(env: Env) -> None:
    proc = env.cli("logs", "-n", "20")
    assert proc.returncode == 0, proc.stderr
    assert "serving on" in proc.stdout
    assert env.calls() == [["journalctl", "--user", "-u", UNIT, "-n", "20", "--no-pager"]]
    proc = env.cli("logs", "--system", "-f", "--dry-run")
    assert proc.stdout.strip() == f"$ journalctl -u {UNIT} -n 50 --no-pager -f"


def test_uninstall_disables_removes_and_reloads(env: Env) -> None:
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    mark = len(env.calls())
    proc = env.cli("uninstall")
    assert proc.returncode == 0, proc.stderr
    assert not env.unit_file.exists()
    assert env.calls()[mark:] == [
        ["systemctl", "--user", "disable", "--now", UNIT],
        ["systemctl", "--user", "daemon-reload"],
    ]


def test_unknown_platform_needs_manager_flag() -> None:
    from mpsd.service.errors import ServiceError
    from mpsd.service.manager import default_manager

    assert default_manager("darwin") == "launchd"
    assert default_manager("linux") == "systemd"
    with pytest.raises(ServiceError) as info:
        default_manager("win32")
    assert info.value.hint is not None and "--manager" in info.value.hint


def test_unit_name_is_validated() -> None:
    from mpsd.service.errors import ServiceError

    assert make_target(Scope.USER, unit="mpsd-gpu0").unit == "mpsd-gpu0.service"
    with pytest.raises(ServiceError):
        make_target(Scope.USER, unit="../evil")


def test_status_names_a_configuration_error_that_stopped_the_restarts() -> None:
    """With RestartPreventExitStatus=78 the unit stays down after a configuration error; status says so."""
    down = "LoadState=loaded\nActiveState=failed\nSubState=failed\nMainPID=0\n"
    down += "ExecMainCode=1\nExecMainStatus=78"
    status = status_from_show(down, "here")
    assert status.problem is not None and "78 (EX_CONFIG)" in status.problem
    crashed = down.replace("ExecMainStatus=78", "ExecMainStatus=1")
    assert status_from_show(crashed, "here").problem is None
