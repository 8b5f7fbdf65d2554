"""`mpsd doctor`, run for real as a command: every check on a healthy setup (a real worker answers on this
machine's device), `--json`, a port taken by a listener the test holds, and macOS's privacy-protected
folders with darwin's facts injected (MPSD_OS_FACTS) and a home of the test's own."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpsd.cli.doctor import CHECKS
from tests import models
from tests.conftest import ROOT, free_port


@dataclass(frozen=True)
class Setup:
    config: Path
    repo: Path
    ports: dict[str, int]


def _write_setup(root: Path) -> Setup:
    """A daemon config on free loopback ports, beside a repository with one valid model."""
    repo = root / "models"
    models.add_sub(repo)
    ports = {name: free_port() for name in ("grpc_address", "http_address", "metrics_address")}
    config = root / "mpsd.yaml"
    config.write_text(
        "model_repository: models\n" + "".join(f"{name}: 127.0.0.1:{port}\n" for name, port in ports.items())
    )
    return Setup(config, repo, ports)


def doctor(*args: str, files: tuple[int, int] | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    """`mpsd doctor ARGS` in a child process, as a user runs it (under the open-file limits `files`)."""

    def limit() -> None:
        if files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, files)

    return subprocess.run(
        [sys.executable, "-m", "mpsd", "doctor", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
        preexec_fn=limit,
    )


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Setup:
    return _write_setup(tmp_path_factory.mktemp("doctor"))


@pytest.fixture(scope="module")
def text_run(healthy: Setup) -> subprocess.CompletedProcess[str]:
    """The whole doctor once, as a user reads it (its worker check starts one real worker)."""
    return doctor("--config", str(healthy.config))


@pytest.fixture(scope="module")
def json_run(healthy: Setup) -> subprocess.CompletedProcess[str]:
    return doctor("--config", str(healthy.config), "--json")


def _lines(run: subprocess.CompletedProcess[str]) -> dict[str, str]:
    """Each check's line, by name: `✅ name: detail` or `❌ name: detail`."""
    found = {}
    for text in run.stdout.splitlines():
        if text[:2] in ("✅ ", "❌ "):
            name, _, _ = text[2:].partition(":")
            found[name] = text
    return found


def test_every_check_passes_on_a_healthy_setup(text_run: subprocess.CompletedProcess[str]) -> None:
    assert text_run.returncode == 0, text_run.stdout + text_run.stderr
    lines = _lines(text_run)
    assert list(lines) == list(CHECKS)
    assert all(line.startswith("✅ ") for line in lines.values()), text_run.stdout
    assert "fix:" not in text_run.stdout


def test_the_worker_check_ran_a_real_worker_on_the_device_kind_auto_gets(
    text_run: subprocess.CompletedProcess[str],
) -> None:
    """The device line and the worker line name the same device: the worker resolved KIND_AUTO as the
    doctor's own probe did, and answered."""
    lines = _lines(text_run)
    device = lines["device"].split("KIND_AUTO gets ", 1)[1].split(" ", 1)[0]
    assert f" on {device} " in lines["worker"], lines["worker"]
    assert "answered a request" in lines["worker"]
    pid = int(lines["worker"].split("pid ", 1)[1].split(" ", 1)[0])
    assert pid not in (os.getpid(), 0)


def test_json_has_the_same_checks(
    json_run: subprocess.CompletedProcess[str], text_run: subprocess.CompletedProcess[str]
) -> None:
    assert json_run.returncode == 0, json_run.stdout + json_run.stderr
    checks = json.loads(json_run.stdout)
    assert [c["check"] for c in checks] == list(_lines(text_run)) == list(CHECKS)
    for c in checks:
        assert set(c) == {"check", "ok", "detail", "fix"}
        assert c["ok"] is True and c["fix"] is None and c["detail"]


def test_the_checks_the_parser_offers_are_the_ones_that_run() -> None:
    from mpsd.tools.doctor import NAMES

    assert NAMES == CHECKS


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    yield sock
    sock.close()


def test_a_taken_port_fails_and_is_named(tmp_path: Path, listener: socket.socket) -> None:
    setup = _write_setup(tmp_path)
    taken = listener.getsockname()[1]
    text = setup.config.read_text().replace(str(setup.ports["http_address"]), str(taken))
    setup.config.write_text(text)
    run = doctor("--config", str(setup.config), "--only", "ports")
    assert run.returncode == 1, run.stdout + run.stderr
    line = _lines(run)["ports"]
    assert line.startswith("❌ ") and f"port {taken} (http_address 127.0.0.1:{taken})" in line
    assert str(setup.ports["grpc_address"]) not in line  # the free ones are not called taken
    assert "fix: " in run.stdout


def test_a_repository_in_documents_is_flagged_with_darwin_facts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    setup = _write_setup(home / "Documents" / "mpsd")
    run = doctor(
        "--config", str(setup.config), "--only", "privacy_folders", MPSD_OS_FACTS="darwin", HOME=str(home)
    )
    assert run.returncode == 1, run.stdout + run.stderr
    line = _lines(run)["privacy_folders"]
    assert line.startswith("❌ ")
    assert f"model repository {setup.repo}" in line and f"(in {home / 'Documents'})" in line
    assert "Full Disk Access" in run.stdout


def test_a_repository_outside_the_protected_folders_passes_with_darwin_facts(tmp_path: Path) -> None:
    home = tmp_path / "home"
    setup = _write_setup(home / "src" / "mpsd")
    run = doctor(
        "--config", str(setup.config), "--only", "privacy_folders", MPSD_OS_FACTS="darwin", HOME=str(home)
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert str(home / "Documents") in _lines(run)["privacy_folders"]


def test_a_low_soft_open_file_limit_passes_when_the_daemon_can_raise_it() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard != resource.RLIM_INFINITY and hard < 10240:
        pytest.skip(f"this machine's hard open-file limit is {hard}, below 10240")
    run = doctor("--only", "open_files", files=(256, hard))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "soft 256, hard " in _lines(run)["open_files"]
    assert ": the daemon raises its soft limit to 10240 at start" in _lines(run)["open_files"]


def test_a_hard_open_file_limit_below_the_wanted_one_fails() -> None:
    run = doctor("--only", "open_files", files=(256, 512))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "can raise its soft limit only to 512; 10240 is recommended" in _lines(run)["open_files"]
    assert "fix: raise the hard limit" in run.stdout
