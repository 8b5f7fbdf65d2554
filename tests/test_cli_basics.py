"""The command line: version output, and configuration errors that stop `mpsd serve` before anything
starts (exit status 78, EX_CONFIG, with one readable line)."""

from __future__ import annotations

import argparse
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version
from pathlib import Path

import pytest
import tritonclient.grpc as grpcclient

import mpsd
from mpsd.cli import build_parser
from tests import models
from tests.conftest import ROOT, free_port, serve_command, wait_for
from tests.os_skips import shared_port_fronts

MPSD_SCRIPT = Path(sys.executable).parent / "mpsd"
EX_CONFIG = 78


def stop_cleanly(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, and the daemon must exit 0; its whole session is killed if it does not."""
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run(args: list[str], cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


@pytest.mark.parametrize(
    "command", [[sys.executable, "-m", "mpsd"], [str(MPSD_SCRIPT)]], ids=["module", "script"]
)
def test_version(command: list[str], tmp_path: Path) -> None:
    result = run([*command, "--version"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"mpsd {mpsd.__version__}"
    assert mpsd.__version__ == version("mpsd")
    assert result.stderr == ""


def marker_model(repo: Path, marker: Path) -> None:
    """A python model whose module touches `marker` when a worker imports it."""
    models.python_model(repo, "probe", "return {'y': inputs['x']}")
    source = repo / "probe" / "1" / "model.py"
    source.write_text(f"open({str(marker)!r}, 'w').close()\n" + source.read_text())


def assert_one_line_error(result: subprocess.CompletedProcess[str], *words: str) -> str:
    assert result.returncode == EX_CONFIG, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("mpsd: ")
    for word in words:
        assert word in lines[0], f"{word!r} not in {lines[0]!r}"
    return lines[0]


def test_unknown_config_key_exits_78_before_starting_anything(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    marker = tmp_path / "model-imported"
    marker_model(repo, marker)
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "mpsd.yaml"
    config.write_text(f"model_repository: {repo}\ngrpc_address: '{address}'\ndrain_timeout: 5\n")
    result = run([str(MPSD_SCRIPT), "serve", "--config", str(config)], tmp_path)
    assert_one_line_error(result, str(config), "drain_timeout", "unknown field")
    assert result.stdout == ""
    assert not marker.exists(), "a worker loaded the model although the configuration was refused"

    # The same command with the key spelt right does start the worker: the marker works.
    config.write_text(f"model_repository: {repo}\ngrpc_address: '{address}'\ndrain_timeout_s: 5\n")
    proc = subprocess.Popen(
        [str(MPSD_SCRIPT), "serve", "--config", str(config)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_for(marker.exists, 120, "the worker to import the model")
    finally:
        stop_cleanly(proc)


@pytest.mark.parametrize(
    "command", [[sys.executable, "-m", "mpsd"], [str(MPSD_SCRIPT)]], ids=["module", "script"]
)
def test_missing_model_repository_exits_78(command: list[str], tmp_path: Path) -> None:
    result = run([*command, "serve", "--model-repository", "/nonexistent"], tmp_path)
    assert_one_line_error(result, "/nonexistent", "not a directory")
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (None, ("config file not found",)),
        ("grpc_address: [unclosed\n", ("invalid YAML", "line 2", "column 1")),
        ("- a list\n", ("expected a mapping",)),
        ("drain_timeout_s: -1\n", ("drain_timeout_s", "greater than 0")),
    ],
    ids=["missing_file", "invalid_yaml", "not_a_mapping", "bad_value"],
)
def test_bad_config_file_exits_78(text: str | None, words: tuple[str, ...], tmp_path: Path) -> None:
    config = tmp_path / "mpsd.yaml"
    if text is not None:
        config.write_text(text)
    result = run([sys.executable, "-m", "mpsd", "serve", "--config", str(config)], tmp_path)
    assert_one_line_error(result, str(config), *words)


def test_serve_waits_for_a_fixed_config_with_on_config_error_wait(tmp_path: Path) -> None:
    """The mode launchd jobs run in (launchd restarts a job whatever its exit status): the error is written
    once, the daemon stays up without serving, and it starts as soon as the config file is fixed."""
    repo = tmp_path / "repo"
    marker = tmp_path / "model-imported"
    address = f"127.0.0.1:{free_port()}"
    config = tmp_path / "mpsd.yaml"
    config.write_text(f"model_repository: {repo}\ngrpc_address: '{address}'\nmetrics_address: ''\n")
    err = tmp_path / "err.log"
    with err.open("w") as err_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mpsd", "serve", "--config", str(config), "--on-config-error", "wait"],
            cwd=tmp_path,
            stdout=subprocess.DEVNULL,
            stderr=err_file,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "mpsd: waiting for a fix of" in err.read_text(), 60, "the daemon to wait")
        assert proc.poll() is None, "it exited instead of waiting"
        lines = err.read_text().splitlines()
        assert lines[0] == f"mpsd: configuration error: model repository {repo} is not a directory"
        marker_model(repo, marker)
        config.write_text(config.read_text() + "# fixed\n")  # a change to the file is what it waits for
        wait_for(marker.exists, 120, "the worker to import the model once the config is fixed")
        assert "mpsd: configuration fixed; starting" in err.read_text()
    finally:
        stop_cleanly(proc)


def _commands(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every command and sub-command of the `mpsd` parser, as the words that name it."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from _commands(sub, (*path, name))


def test_every_command_has_help_with_an_example() -> None:
    """README.md: every command has --help with examples (the help each prints is its parser's)."""
    commands = list(_commands(build_parser()))
    assert ("service", "install") in commands and ("serve",) in commands
    for words in commands:
        result = subprocess.run(
            [sys.executable, "-m", "mpsd", *words, "--help"],
            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},  # one example, one line
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, (words, result.stderr)
        found = re.search(r"^examples?:\n?\s+(mpsd " + " ".join(words) + ".*)$", result.stdout, re.M)
        assert found, (words, result.stdout)
        example = shlex.split(re.split(r"[#|]", found.group(1))[0])
        build_parser().parse_args(example[1:])  # the example is a valid command line (else SystemExit)


@pytest.mark.parametrize("command", ["reload", "status", "health", "logs", "models"])
def test_errors_are_one_line_and_a_hint_and_debug_shows_the_traceback(command: str, tmp_path: Path) -> None:
    """README.md: errors are one line and a hint; --debug shows tracebacks."""
    args = [command, "--address", f"127.0.0.1:{free_port()}", "--timeout", "2"]  # nothing listens there
    plain = run([sys.executable, "-m", "mpsd", *args], tmp_path)
    assert plain.returncode == 69
    assert "Traceback" not in plain.stderr
    lines = [line for line in plain.stderr.splitlines() if line.strip()]
    assert len(lines) == 2 and lines[0].startswith("mpsd") and lines[1].startswith("hint: "), plain.stderr
    debug = run([sys.executable, "-m", "mpsd", "--debug", *args], tmp_path)
    assert debug.returncode != 0
    assert "Traceback (most recent call last)" in debug.stderr


def test_config_paths_are_relative_to_its_file_and_flags_override_it(tmp_path: Path) -> None:
    """docs/daemon-config.md: relative paths (the repository, token files) follow the config file, not the
    working directory; --grpc-address, --metrics-address and --log-level override the file; a token file
    others may read is warned about (docs/security.md)."""
    etc = tmp_path / "etc"
    marker = tmp_path / "model-imported"
    marker_model(etc / "models", marker)
    (etc / "secrets").mkdir()
    (etc / "secrets" / "app.token").write_text("  s3cret-token \n")
    (etc / "secrets" / "app.token").chmod(0o644)
    file_port, flag_port, flag_metrics = free_port(), free_port(), free_port()
    (etc / "mpsd.yaml").write_text(
        "model_repository: models\n"
        f"grpc_address: '127.0.0.1:{file_port}'\n"
        f"metrics_address: '127.0.0.1:{free_port()}'\n"
        "log_level: error\n"
        "auth:\n"
        "  tokens: [{token_file: secrets/app.token, categories: [inference, health, model-repository]}]\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    flags = ["--grpc-address", f"127.0.0.1:{flag_port}", "--metrics-address", f"127.0.0.1:{flag_metrics}"]
    log = tmp_path / "daemon.log"
    with log.open("w") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mpsd",
                "serve",
                "--config",
                "../etc/mpsd.yaml",
                *flags,
                "--log-level",
                "info",
            ],
            cwd=elsewhere,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{flag_port}")
    headers = {"authorization": "Bearer s3cret-token"}  # the file's token, whitespace around it ignored
    try:
        wait_for(
            lambda: client.is_model_ready("probe", headers=headers), 120, f"probe ready\n{log.read_text()}"
        )
        assert marker.exists()
        index = client.get_model_repository_index(headers=headers, as_json=True)["models"]
        assert [m["name"] for m in index] == ["probe"]
        with socket.socket() as probe:
            assert probe.connect_ex(("127.0.0.1", file_port)) != 0, "the file's address was used"
        text = log.read_text()
        assert f"127.0.0.1:{flag_metrics}" in text  # the metrics endpoint at the flag's address
        assert '"level": "info"' in text  # --log-level info over the file's error
        assert "token file is readable by other users" in text
    finally:
        client.close()
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


@pytest.mark.parametrize("fronts", ["0", pytest.param("2", marks=shared_port_fronts())])
def test_a_port_in_use_is_one_line_naming_it(
    tmp_path: Path, fronts: str, sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/troubleshooting.md's message, with front processes or without: one line naming the address, exit
    status 78 (the operator's to fix, as a config error), found before anything starts. A dead daemon's
    socket folder, removed at every start, is told only by a start that listens."""
    repo = tmp_path / "repo"
    repo.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(sock_dir))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    (sock_dir / f"mpsd-daemon-{gone.pid}-abc").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        serve = [*serve_command(repo, address), "--metrics-address", ""]
        done = run([*serve, "--front-processes", fronts], tmp_path)
    assert done.returncode == 78, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == [f"mpsd: configuration error: cannot listen on {address}: the port is in use"], lines
