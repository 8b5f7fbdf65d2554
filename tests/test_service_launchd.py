"""launchd integration: the rendered plist, and the launchctl command sequences of `mpsd service`.

launchd cannot run on this (Linux) test machine, so the command tests put a recording stand-in
`launchctl` first on PATH. It logs its argv, keeps "loaded" state in files, answers `print` like the
real tool and can be told to fail `bootstrap` with error 5. The plist is additionally checked with
`plistutil` (libplist), a parser independent of Python's plistlib, or on a Mac without it with the system's
own `plutil`.
"""

from __future__ import annotations

import json
import os
import plistlib
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

from mpsd import osfacts
from mpsd.service import launchd
from mpsd.service.errors import ServiceError
from mpsd.service.launchctl import parse_print, status_from_print
from mpsd.service.spec import Scope, ServiceSpec, check_privileges, make_spec, make_target
from tests import models
from tests.conftest import free_port, wait_for
from tests.os_skips import not_installed
from tests.service_fakes import PROCESS_CONTROL, kill_started

REPO = Path(__file__).resolve().parents[1]
TEMPLATE = REPO / "launchd" / "io.mpsd.daemon.plist.in"
UID = os.getuid()
LABEL = "io.mpsd.daemon"

FAKE_LAUNCHCTL = textwrap.dedent(
    """\
    #!@PYTHON@
    # Stand-in launchctl: records argv, keeps loaded labels as files in $FAKE_STATE.
    import json, os, plistlib, sys
    from pathlib import Path

    state = Path(os.environ["FAKE_STATE"])
    state.mkdir(parents=True, exist_ok=True)
    args = sys.argv[1:]
    with open(state / "calls.jsonl", "a") as log:
        log.write(json.dumps(args) + "\\n")

    def flag(service):
        return state / ("loaded-" + service.replace("/", "_"))

    def bump(name):
        counter = state / ("count-" + name)
        n = int(counter.read_text()) + 1 if counter.exists() else 1
        counter.write_text(str(n))
        return n

    @PROCESS_CONTROL@

    def start_job(job):
        # What launchd does with the job (FAKE_EXEC): run ProgramArguments in WorkingDirectory with
        # EnvironmentVariables, stdout and stderr into the job's log files.
        for key in ("StandardOutPath", "StandardErrorPath"):
            Path(job[key]).parent.mkdir(parents=True, exist_ok=True)
        start_process(job["ProgramArguments"], job["WorkingDirectory"], job["EnvironmentVariables"],
                      job["StandardOutPath"], job["StandardErrorPath"])

    verb = args[0]
    if verb == "print":
        target = args[1]
        if target.count("/") == 1 or target == "system":
            if target.startswith("gui/") and os.environ.get("FAKE_NO_GUI"):
                print("Could not find domain for", file=sys.stderr)
                sys.exit(113)
            print(target + " = {\\n}")
            sys.exit(0)
        f = flag(target)
        if not f.exists():
            print("Could not find service in domain", file=sys.stderr)
            sys.exit(113)
        text = f.read_text()
        if text.startswith("draining "):
            left = int(text.split()[1])
            if left <= 0:
                f.unlink()
                print("Could not find service in domain", file=sys.stderr)
                sys.exit(113)
            f.write_text("draining %d" % (left - 1))
        print(target + " = {")
        print("\\tactive count = 1")
        print("\\tpath = " + text.splitlines()[0] if not text.startswith("draining") else "\\tpath = x")
        print("\\tstate = running")
        print("\\targuments = {")
        print("\\t\\tstate = not-the-top-level-state")
        print("\\t}")
        print("\\tenvironment = {")
        print("\\t\\tpid => 1")
        print("\\t}")
        print("\\tpid = " + ((state / "pid").read_text() if (state / "pid").exists() else "4242"))
        print("\\tlast exit code = " + os.environ.get("FAKE_LAST_EXIT", "(never exited)"))
        print("}")
        sys.exit(0)
    if verb == "bootstrap":
        domain, plist = args[1], args[2]
        if bump("bootstrap") <= int(os.environ.get("FAKE_BOOTSTRAP_FAILS", "0")):
            print("Bootstrap failed: 5: Input/output error", file=sys.stderr)
            print("Try re-running the command as root for richer errors.", file=sys.stderr)
            sys.exit(5)
        with open(plist, "rb") as handle:
            job = plistlib.load(handle)
        flag(domain + "/" + job["Label"]).write_text(plist)
        if os.environ.get("FAKE_EXEC"):
            start_job(job)
        sys.exit(0)
    if verb == "bootout":
        f = flag(args[1])
        if not f.exists():
            print("Boot-out failed: 3: No such process", file=sys.stderr)
            sys.exit(3)
        stop_process()
        linger = int(os.environ.get("FAKE_LINGER", "0"))
        if linger:
            f.write_text("draining %d" % linger)
        else:
            f.unlink()
        sys.exit(0)
    if verb == "kickstart" and os.environ.get("FAKE_EXEC"):  # -k: kill the running job, start it again
        with open(flag(args[-1]).read_text().splitlines()[0], "rb") as handle:
            job = plistlib.load(handle)
        stop_process()
        start_job(job)
        sys.exit(0)
    if verb in ("enable", "disable", "kickstart"):
        sys.exit(0)
    print("stand-in launchctl: unexpected " + repr(args), file=sys.stderr)
    sys.exit(64)
    """
)
FAKE_LAUNCHCTL = FAKE_LAUNCHCTL.replace("@PROCESS_CONTROL@", PROCESS_CONTROL)


# -- helpers -----------------------------------------------------------------------------------------


class Env:
    """A sandbox: HOME, a bin dir with the stand-in launchctl first on PATH, and its state dir."""

    def __init__(self, tmp_path: Path) -> None:
        self.home = tmp_path / "home"
        self.home.mkdir()
        self.state = tmp_path / "state"
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        fake = bin_dir / "launchctl"
        fake.write_text(FAKE_LAUNCHCTL.replace("@PYTHON@", sys.executable))
        fake.chmod(0o755)
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
    def plist(self) -> Path:
        return self.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"

    def cli(self, *args: str, **extra_env: str) -> subprocess.CompletedProcess[str]:
        """Run `python -m mpsd.service ...` (the same parser `mpsd service ...` uses)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "NOTIFY_"))}
        env.update(self.vars)
        env.update(extra_env)
        return subprocess.run(
            [sys.executable, "-m", "mpsd.service", *args, "--manager", "launchd"],
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

    def mutating_calls(self) -> list[list[str]]:
        """Everything except the read-only `print` queries."""
        return [call for call in self.calls() if call[0] != "print"]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    made = Env(tmp_path)
    yield made
    kill_started(made.state)


@pytest.fixture
def serving_address() -> Iterator[str]:
    """A real gRPC server on a free loopback port whose health service reports SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None).wait()


@pytest.fixture
def silent_address() -> str:
    """A loopback port nothing listens on (bound and closed again)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"127.0.0.1:{port}"


def _spec(tmp_path: Path, scope: Scope, **overrides: object) -> tuple[ServiceSpec, Path]:
    config = tmp_path / "cfg" / "mpsd.yaml"
    config.parent.mkdir(exist_ok=True)
    config.write_text("drain_timeout_s: 30\n")
    home = tmp_path / "home"
    target = make_target(scope, home=home, uid=501)
    kwargs: dict[str, object] = {
        "config": config,
        "base_path": launchd.BASE_PATH,
        "environment": {"PYTORCH_ENABLE_MPS_FALLBACK": "1"},
    }
    if scope is Scope.SYSTEM:
        kwargs.update(service_user="_mpsd", service_home="/var/lib/mpsd")
    kwargs.update(overrides)
    return make_spec(target, **kwargs), home  # type: ignore[arg-type]


def _render(tmp_path: Path, scope: Scope, **overrides: object) -> dict[str, object]:
    spec, home = _spec(tmp_path, scope, **overrides)
    target = make_target(scope, home=home, uid=501)
    return plistlib.loads(launchd.render_plist(spec, target))  # type: ignore[no-any-return]


def _plist_converter(source: Path, binary: Path) -> list[str]:
    """The command that converts the XML plist `source` to the binary `binary`: libplist's plistutil, or on
    macOS its own plutil (Apple's parser, always there) where plistutil is not installed."""
    plistutil = shutil.which("plistutil")
    if plistutil is not None:
        return [plistutil, "-i", str(source), "-f", "bin", "-o", str(binary)]
    plutil = shutil.which("plutil") if osfacts.current().name == "darwin" else None
    if plutil is not None:
        return [plutil, "-convert", "binary1", "-o", str(binary), str(source)]
    pytest.skip(not_installed("plistutil"))


def _plistutil_roundtrip(xml: bytes, tmp_path: Path) -> object:
    """Parse with a parser other than plistlib (XML -> binary), then read its binary output back."""
    source, binary = tmp_path / "check.plist", tmp_path / "check.bplist"
    source.write_bytes(xml)
    binary.unlink(missing_ok=True)
    proc = subprocess.run(_plist_converter(source, binary), capture_output=True, text=True, check=False)
    # plistutil 2.2 exits 0 even when it rejects the input, so its error text and output are checked.
    assert "ERROR" not in proc.stderr + proc.stdout, proc.stderr
    assert proc.returncode == 0
    data = binary.read_bytes()
    assert data.startswith(b"bplist00")
    return plistlib.loads(data, fmt=plistlib.FMT_BINARY)


# -- the plist ---------------------------------------------------------------------------------------


def test_plistutil_rejects_a_broken_plist(tmp_path: Path) -> None:
    """The independent check can fail: a mistyped tag must not pass."""
    broken = b'<?xml version="1.0"?><plist version="1.0"><dict><key>a</key><strin>x</string></dict></plist>'
    with pytest.raises(AssertionError):
        _plistutil_roundtrip(broken, tmp_path)


@pytest.mark.parametrize("scope", [Scope.USER, Scope.SYSTEM])
def test_rendered_plist_parses_with_plistlib_and_plistutil(tmp_path: Path, scope: Scope) -> None:
    spec, home = _spec(tmp_path, scope)
    xml = launchd.render_plist(spec, make_target(scope, home=home, uid=501))
    assert _plistutil_roundtrip(xml, tmp_path) == plistlib.loads(xml)


def test_user_plist_has_every_key_with_the_right_type(tmp_path: Path) -> None:
    job = _render(tmp_path, Scope.USER)
    assert job["Label"] == LABEL
    args = job["ProgramArguments"]
    assert isinstance(args, list) and all(isinstance(a, str) for a in args)
    assert args[0] == sys.executable and os.path.isabs(args[0])
    assert args[1:5] == ["-m", "mpsd", "serve", "--config"]
    assert args[5] == str((tmp_path / "cfg" / "mpsd.yaml").resolve())
    assert args[6:] == ["--on-config-error", "wait"]  # launchd cannot stop restarting on exit 78
    assert job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    for key in ("ThrottleInterval", "ExitTimeOut"):
        assert type(job[key]) is int, key
    assert job["ThrottleInterval"] == 10
    assert job["ProcessType"] == "Interactive"
    log_dir = tmp_path / "home" / "Library" / "Logs" / "mpsd"
    assert job["StandardOutPath"] == str(log_dir / f"{LABEL}.out.log")
    assert job["StandardErrorPath"] == str(log_dir / f"{LABEL}.err.log")
    assert job["WorkingDirectory"] == str((tmp_path / "cfg").resolve())
    env = job["EnvironmentVariables"]
    assert isinstance(env, dict) and all(isinstance(v, str) for v in env.values())
    assert env["HOME"] == str(tmp_path / "home")
    assert env["PATH"].split(":")[0] == os.path.dirname(sys.executable)
    assert "/usr/bin" in env["PATH"].split(":")
    assert env["PYTORCH_ENABLE_MPS_FALLBACK"] == "1"
    assert "UserName" not in job
    assert "LimitLoadToSessionType" not in job
    # launchd would start the daemon with 256 open files: both limits at macOS's OPEN_MAX
    assert job["SoftResourceLimits"] == {"NumberOfFiles": 10240}
    assert job["HardResourceLimits"] == {"NumberOfFiles": 10240}
    for key in ("StandardOutPath", "StandardErrorPath", "WorkingDirectory"):
        assert os.path.isabs(str(job[key])), key


def test_system_plist_runs_as_service_account_and_logs_to_library_logs(tmp_path: Path) -> None:
    job = _render(tmp_path, Scope.SYSTEM)
    assert job["UserName"] == "_mpsd"
    assert job["StandardOutPath"] == f"/Library/Logs/mpsd/{LABEL}.out.log"
    assert job["StandardErrorPath"] == f"/Library/Logs/mpsd/{LABEL}.err.log"
    assert job["EnvironmentVariables"]["HOME"] == "/var/lib/mpsd"  # type: ignore[index]
    assert job["ProcessType"] == "Interactive"
    assert launchd.plist_path(make_target(Scope.SYSTEM, home=tmp_path, uid=0)) == Path(
        f"/Library/LaunchDaemons/{LABEL}.plist"
    )


@pytest.mark.parametrize("drain", [0.0, 0.5, 30.0, 29.9, 600.0])
def test_exit_timeout_is_longer_than_the_drain_timeout(tmp_path: Path, drain: float) -> None:
    job = _render(tmp_path, Scope.USER, drain_timeout_s=drain)
    exit_timeout = job["ExitTimeOut"]
    assert isinstance(exit_timeout, int) and exit_timeout > drain


@pytest.mark.parametrize(("open_files", "written"), [(4096, 4096), (65536, 10240), (0, None)])
def test_open_file_limits_follow_the_daemons_setting(
    tmp_path: Path, open_files: int, written: int | None
) -> None:
    """The config's `open_files`, capped at OPEN_MAX (setrlimit refuses more on macOS); 0: launchd's own."""
    config = tmp_path / "mpsd.yaml"
    config.write_text(f"open_files: {open_files}\n")
    target = make_target(Scope.USER, home=tmp_path / "home", uid=501)
    spec = make_spec(target, config=config, base_path=launchd.BASE_PATH)
    job = plistlib.loads(launchd.render_plist(spec, target))
    for key in ("SoftResourceLimits", "HardResourceLimits"):
        if written is None:
            assert key not in job
        else:
            assert job[key] == {"NumberOfFiles": written}
            assert type(job[key]["NumberOfFiles"]) is int  # type: ignore[index]


def test_background_session_type_only_when_asked(tmp_path: Path) -> None:
    spec, home = _spec(tmp_path, Scope.USER)
    target = make_target(Scope.USER, home=home, uid=501)
    job = plistlib.loads(launchd.render_plist(spec, target, session_type="Background"))
    assert job["LimitLoadToSessionType"] == "Background"


def test_template_in_launchd_dir_is_the_renderer_output(tmp_path: Path) -> None:
    """launchd/io.mpsd.daemon.plist.in is documentation; it must not drift from the code."""
    spec = ServiceSpec(
        python="@PYTHON@",
        config="@CONFIG@",
        working_dir="@WORKING_DIR@",
        environment={"PATH": "@PATH@", "HOME": "@HOME@"},
    )
    target = make_target(Scope.USER, home=Path("@HOME@"), uid=501)
    assert launchd.render_plist(spec, target).decode() == TEMPLATE.read_text()
    _plistutil_roundtrip(TEMPLATE.read_bytes(), tmp_path)


def test_check_privileges_refuses_system_scope_for_non_root() -> None:
    with pytest.raises(ServiceError) as info:
        check_privileges(Scope.SYSTEM, euid=501)
    assert "root" in info.value.message
    assert info.value.hint is not None and "--user" in info.value.hint
    check_privileges(Scope.SYSTEM, euid=0)
    check_privileges(Scope.USER, euid=501)


def test_parse_print_reads_only_the_top_level_block() -> None:
    text = textwrap.dedent(
        """\
        gui/501/io.mpsd.daemon = {
        \tactive count = 0
        \tstate = not running
        \tendpoints = {
        \t\t"x" = {
        \t\t\tstate = active
        \t\t}
        \t}
        \tpid = 77
        \tlast exit code = 1
        \tlast terminating signal = Killed: 9
        }
        """
    )
    assert parse_print(text)["state"] == "not running"
    status = status_from_print(text, "here")
    assert (status.state, status.pid) == ("not running", 77)
    assert status.last_exit == "1 (Killed: 9)"


# -- commands through the CLI ------------------------------------------------------------------------


def test_install_bootstraps_enables_and_waits_for_health(env: Env, serving_address: str) -> None:
    proc = env.cli("install", "--config", str(env.config), "--address", serving_address)
    assert proc.returncode == 0, proc.stderr
    assert env.mutating_calls() == [
        ["enable", f"gui/{UID}/{LABEL}"],
        ["bootstrap", f"gui/{UID}", str(env.plist)],
    ]
    assert ["print", f"gui/{UID}"] in env.calls()  # GUI session detection
    job = plistlib.loads(env.plist.read_bytes())
    assert job["ProgramArguments"][0] == sys.executable
    assert job["ExitTimeOut"] > 30
    assert (env.plist.stat().st_mode & 0o777) == 0o644
    assert (env.home / "Library" / "Logs" / "mpsd").is_dir()
    assert "waiting for mpsd to report SERVING" in proc.stderr and "ready after" in proc.stderr
    assert str(env.home / "Library" / "Logs" / "mpsd" / f"{LABEL}.err.log") in proc.stdout


def test_install_polls_grpc_address_from_config(env: Env, serving_address: str) -> None:
    """A wildcard listen address is polled on loopback."""
    port = serving_address.rsplit(":", 1)[1]
    env.config.write_text(f"drain_timeout_s: 30\ngrpc_address: 0.0.0.0:{port}\n")
    proc = env.cli("install", "--config", str(env.config), "--wait-timeout", "30")
    assert proc.returncode == 0, proc.stderr
    assert f"on 127.0.0.1:{port}" in proc.stderr


def test_install_refuses_a_config_the_daemon_would_refuse(env: Env) -> None:
    """launchd cannot tell a configuration error (exit 78) from a crash and would start the daemon again
    and again: such a config is refused before anything is written or loaded."""
    env.config.write_text("model_repository: /nonexistent/models\n")
    proc = env.cli("install", "--config", str(env.config), "--no-wait")
    assert proc.returncode == 1
    assert "configuration error: model repository /nonexistent/models is not a directory" in proc.stderr
    assert "nothing was installed" in proc.stderr
    assert not env.plist.exists()
    assert env.calls() == []


def test_install_starts_the_plists_command_line_and_waits_for_that_daemon(env: Env) -> None:
    """No stand-in server: the stand-in launchctl runs the plist's own ProgramArguments (FAKE_EXEC), so
    install waits for the real daemon that command line starts; then a config broken while it is
    installed holds the restarted daemon in its waiting state, which status reports."""
    repo = env.config.parent / "models"
    models.add_sub(repo)
    address = f"127.0.0.1:{free_port()}"
    good = f"grpc_address: '{address}'\nmetrics_address: ''\ndrain_timeout_s: 5\n"
    env.config.write_text(good)
    proc = env.cli("install", "--config", str(env.config), "--wait-timeout", "120", FAKE_EXEC="1")
    err_log = env.home / "Library" / "Logs" / "mpsd" / f"{LABEL}.err.log"
    assert proc.returncode == 0, proc.stderr + (err_log.read_text() if err_log.exists() else "")
    pid = int((env.state / "pid").read_text())
    client = grpcclient.InferenceServerClient(address)
    try:
        # install waited for liveness (health ""); the model is served by that same daemon once loaded
        wait_for(lambda: client.is_model_ready("add_sub"), 120, "the installed daemon serving add_sub")
    finally:
        client.close()
    assert env.cli("status", FAKE_EXEC="1").returncode == 0
    # Each start says so, so an error an earlier run logged is not taken for this run's.
    assert "mpsd: configuration accepted; starting" in err_log.read_text()

    env.config.write_text(good + "front_processes: nine\n")
    assert env.cli("restart", "--no-wait", FAKE_EXEC="1").returncode == 0
    wait_for(lambda: "mpsd: waiting for a fix" in err_log.read_text(), 60, "the restarted daemon to wait")
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    status = env.cli("status", FAKE_EXEC="1")
    assert status.returncode == 3
    assert "not serving: configuration error:" in status.stdout and "front_processes" in status.stdout


def test_install_written_plist_passes_plistutil(env: Env, tmp_path: Path) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait")
    assert proc.returncode == 0, proc.stderr
    assert _plistutil_roundtrip(env.plist.read_bytes(), tmp_path) == plistlib.loads(env.plist.read_bytes())


def test_install_takes_drain_timeout_from_config(env: Env) -> None:
    env.config.write_text("drain_timeout_s: 100\n")
    proc = env.cli("install", "--config", str(env.config), "--no-wait")
    assert proc.returncode == 0, proc.stderr
    assert plistlib.loads(env.plist.read_bytes())["ExitTimeOut"] > 100


def test_install_retries_after_bootstrap_io_error(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait", FAKE_BOOTSTRAP_FAILS="1")
    assert proc.returncode == 0, proc.stderr
    assert env.mutating_calls() == [
        ["enable", f"gui/{UID}/{LABEL}"],
        ["bootstrap", f"gui/{UID}", str(env.plist)],
        ["bootout", f"gui/{UID}/{LABEL}"],
        ["bootstrap", f"gui/{UID}", str(env.plist)],
    ]
    assert "retrying (2/3)" in proc.stderr


def test_install_gives_up_after_bounded_retries(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait", FAKE_BOOTSTRAP_FAILS="99")
    assert proc.returncode == 1
    assert [c[0] for c in env.mutating_calls()].count("bootstrap") == 3
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("mpsd service: error:")]
    assert len(errors) == 1 and "Bootstrap failed: 5: Input/output error" in errors[0]
    assert "hint:" in proc.stderr


def test_install_replaces_a_loaded_job_after_it_has_exited(env: Env) -> None:
    """A loaded label is booted out and bootstrap waits until `print` stops finding it."""
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    first = len(env.calls())
    proc = env.cli("install", "--config", str(env.config), "--no-wait", FAKE_LINGER="2")
    assert proc.returncode == 0, proc.stderr
    again = env.calls()[first:]
    bootout = again.index(["bootout", f"gui/{UID}/{LABEL}"])
    bootstrap = again.index(["bootstrap", f"gui/{UID}", str(env.plist)])
    polls = [c for c in again[bootout:bootstrap] if c == ["print", f"gui/{UID}/{LABEL}"]]
    assert len(polls) >= 3  # twice still loaded, then gone


def test_install_without_gui_session_uses_user_domain(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait", FAKE_NO_GUI="1")
    assert proc.returncode == 0, proc.stderr
    assert env.mutating_calls() == [
        ["enable", f"user/{UID}/{LABEL}"],
        ["bootstrap", f"user/{UID}", str(env.plist)],
    ]
    assert plistlib.loads(env.plist.read_bytes())["LimitLoadToSessionType"] == "Background"
    assert f"user/{UID}" in proc.stderr


def test_install_fails_clearly_when_nothing_answers(env: Env, silent_address: str) -> None:
    proc = env.cli("install", "--config", str(env.config), "--address", silent_address, "--wait-timeout", "1")
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert f"did not report SERVING on {silent_address} within 1 s" in proc.stderr
    assert "hint:" in proc.stderr and "running" in proc.stderr  # state from `launchctl print`


def test_dry_run_prints_plist_and_commands_and_runs_nothing(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert env.calls() == []
    assert not env.plist.exists() and not (env.home / "Library").exists()
    xml = proc.stdout[proc.stdout.index("<?xml") : proc.stdout.index("</plist>") + len("</plist>")]
    assert plistlib.loads(xml.encode())["Label"] == LABEL
    assert f"$ launchctl enable gui/{UID}/{LABEL}" in proc.stdout
    assert f"$ launchctl bootstrap gui/{UID} {env.plist}" in proc.stdout
    assert "SERVING" in proc.stdout


def test_dry_run_system_scope(env: Env) -> None:
    proc = env.cli(
        "install",
        "--system",
        "--config",
        str(env.config),
        "--dry-run",
        "--service-user",
        "_mpsd",
        "--service-home",
        "/var/empty",
    )
    assert proc.returncode == 0, proc.stderr
    assert env.calls() == []
    xml = proc.stdout[proc.stdout.index("<?xml") : proc.stdout.index("</plist>") + len("</plist>")]
    job = plistlib.loads(xml.encode())
    assert job["UserName"] == "_mpsd"
    assert job["StandardErrorPath"].startswith("/Library/Logs/mpsd/")
    assert f"/Library/LaunchDaemons/{LABEL}.plist" in proc.stdout
    assert f"$ launchctl bootstrap system /Library/LaunchDaemons/{LABEL}.plist" in proc.stdout
    assert not Path(f"/Library/LaunchDaemons/{LABEL}.plist").exists()


def test_status_reports_state_pid_and_last_exit(env: Env) -> None:
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    proc = env.cli("status", FAKE_LAST_EXIT="78")
    assert proc.returncode == 0, proc.stderr
    first = proc.stdout.splitlines()[0]
    assert first == f"{LABEL}: running, pid 4242, last exit 78"
    assert f"gui/{UID}/{LABEL}" in proc.stdout


def test_status_reports_the_configuration_error_the_daemon_waits_on(env: Env) -> None:
    """Under launchd a daemon with a broken config waits (`--on-config-error wait`) instead of exiting 78
    in a loop; status reads the error from its log and says it is not serving. The log is what the daemon
    writes (test_serve_waits_for_a_fixed_config runs that daemon)."""
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    err_log = env.home / "Library" / "Logs" / "mpsd" / f"{LABEL}.err.log"
    err_log.parent.mkdir(parents=True, exist_ok=True)
    err_log.write_text(
        "mpsd: configuration error: model repository /x is not a directory\n"
        f"mpsd: waiting for a fix of {env.config} (checked again when it changes)\n"
    )
    proc = env.cli("status")
    assert proc.returncode == 3, proc.stdout
    assert "not serving: configuration error: model repository /x is not a directory" in proc.stdout
    with err_log.open("a") as log:  # fixed, and restarted: a quiet daemon (log_level: error) says only this
        log.write("mpsd: configuration accepted; starting\n")
    proc = env.cli("status")
    assert proc.returncode == 0, proc.stdout
    assert "configuration error" not in proc.stdout


def test_status_when_not_installed(env: Env) -> None:
    proc = env.cli("status")
    assert proc.returncode == 3
    assert "not installed" in proc.stdout


def test_stop_start_restart_use_bootout_bootstrap_kickstart(env: Env) -> None:
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    mark = len(env.mutating_calls())
    assert env.cli("restart", "--no-wait").returncode == 0
    assert env.cli("stop").returncode == 0
    assert env.cli("start", "--no-wait").returncode == 0
    assert env.cli("start", "--no-wait").returncode == 0
    assert env.mutating_calls()[mark:] == [
        ["kickstart", "-k", f"gui/{UID}/{LABEL}"],
        ["bootout", f"gui/{UID}/{LABEL}"],
        ["enable", f"gui/{UID}/{LABEL}"],
        ["bootstrap", f"gui/{UID}", str(env.plist)],
        ["kickstart", f"gui/{UID}/{LABEL}"],
    ]


def test_start_when_not_installed_is_one_line_error(env: Env) -> None:
    proc = env.cli("start", "--no-wait")
    assert proc.returncode == 1
    assert proc.stderr.splitlines() == [
        f"mpsd service: error: {LABEL} is not installed",
        "hint: run: mpsd service install",
    ]


def test_uninstall_boots_out_and_removes_plist(env: Env) -> None:
    assert env.cli("install", "--config", str(env.config), "--no-wait").returncode == 0
    proc = env.cli("uninstall")
    assert proc.returncode == 0, proc.stderr
    assert env.mutating_calls()[-1] == ["bootout", f"gui/{UID}/{LABEL}"]
    assert not env.plist.exists()


def test_logs_tails_both_files(env: Env) -> None:
    log_dir = env.home / "Library" / "Logs" / "mpsd"
    log_dir.mkdir(parents=True)
    (log_dir / f"{LABEL}.err.log").write_text("e1\ne2\ne3\n")
    (log_dir / f"{LABEL}.out.log").write_text("o1\no2\n")
    proc = env.cli("logs", "-n", "1")
    assert proc.returncode == 0, proc.stderr
    assert "e3" in proc.stdout and "o2" in proc.stdout
    assert "e2" not in proc.stdout


def test_logs_follow_dry_run(env: Env) -> None:
    proc = env.cli("logs", "-f", "--dry-run")
    assert proc.returncode == 0
    assert proc.stdout.startswith("$ tail -n 50 -F ")


def test_logs_without_files_is_one_line_error(env: Env) -> None:
    proc = env.cli("logs")
    assert proc.returncode == 1
    assert "no log files yet" in proc.stderr and "Traceback" not in proc.stderr


def test_missing_config_is_one_line_error(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.home / "nope.yaml"), "--no-wait")
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[0].startswith("mpsd service: error: config file not found")
    assert proc.stderr.splitlines()[1].startswith("hint: ")
    assert env.calls() == []
