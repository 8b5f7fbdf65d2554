"""macOS: while it serves, the daemon holds off idle sleep with a `caffeinate -i -w <its pid>` child, ended
at shutdown. Darwin's facts are injected into a real daemon (MPSD_OS_FACTS), and a fake `caffeinate` first
on PATH records how it was started and waits."""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest
from conftest import wait_for

from mpsd import osfacts

EVENT = "keeping the Mac from idle sleep while serving"


def fake_caffeinate(tmp_path: Path) -> tuple[Path, Path]:
    """A directory holding a `caffeinate` that writes "<its pid> <its arguments>" to the record, then
    sleeps under the same pid; and the record's path."""
    bin_dir, record = tmp_path / "bin", tmp_path / "caffeinate.record"
    bin_dir.mkdir()
    script = bin_dir / "caffeinate"
    script.write_text(
        f'#!/bin/sh\necho "$$ $*" > "{record}.tmp"\nmv "{record}.tmp" "{record}"\nexec sleep 600\n'
    )
    script.chmod(0o755)
    return bin_dir, record


def caffeinates(daemon_pid: int, bin_dir: Path) -> list[int]:
    """The daemon's children that are the fake caffeinate (its shell, or the sleep it became)."""
    found = []
    for child in psutil.Process(daemon_pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if str(bin_dir / "caffeinate") in argv or argv == ["sleep", "600"]:
            found.append(child.pid)
    return found


def env_with(bin_dir: Path, facts: osfacts.OsFacts) -> dict[str, str]:
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", osfacts.ENV: facts.name}


def test_on_macos_the_daemon_runs_caffeinate_on_itself_while_it_serves(tmp_path: Path, start_daemon) -> None:  # type: ignore[no-untyped-def]
    bin_dir, record = fake_caffeinate(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    daemon = start_daemon(repo, env=env_with(bin_dir, osfacts.DARWIN))
    daemon.wait_ready()
    pid_text, *argv = wait_for(lambda: record.exists() and record.read_text().split(), 30, "caffeinate")
    pid = int(pid_text)
    assert argv == ["-i", "-w", str(daemon.pid)]  # idle sleep, for as long as the daemon lives
    assert caffeinates(daemon.pid, bin_dir) == [pid]
    assert EVENT in daemon.log()
    assert daemon.stop() == 0
    assert not psutil.pid_exists(pid)  # ended and reaped by the daemon, not left to -w


@pytest.mark.parametrize(
    ("facts", "config"), [(osfacts.DARWIN, "prevent_idle_sleep: false\n"), (osfacts.LINUX, "")]
)
def test_caffeinate_is_never_started_when_turned_off_or_off_macos(
    tmp_path: Path, start_daemon, facts: osfacts.OsFacts, config: str
) -> None:  # type: ignore[no-untyped-def]
    bin_dir, record = fake_caffeinate(tmp_path)
    repo = tmp_path / "repo"
    repo.mkdir()
    (tmp_path / "mpsd.yaml").write_text(config or "{}\n")
    daemon = start_daemon(repo, env=env_with(bin_dir, facts), config=tmp_path / "mpsd.yaml")
    daemon.wait_ready()  # caffeinate would have been started, and logged, before the daemon listens
    assert EVENT not in daemon.log()
    assert caffeinates(daemon.pid, bin_dir) == []
    assert not record.exists()
