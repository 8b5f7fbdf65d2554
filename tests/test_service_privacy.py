"""macOS's privacy-protected folders: a launchd job cannot open files in ~/Documents, ~/Desktop, ~/Downloads,
iCloud Drive or /Volumes, so `mpsd service install` refuses such paths before it touches launchctl.

darwin's facts are injected: in-process with `osfacts.use`, in the child `mpsd service` with
MPSD_OS_FACTS=darwin; the stand-in launchctl of test_service_launchd records whether it was called."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from mpsd import osfacts
from mpsd.service import privacy
from tests.service_fakes import kill_started
from tests.test_service_launchd import Env

DARWIN = {"MPSD_OS_FACTS": "darwin"}


def test_paths_in_protected_folders_are_found_as_given_resolved_and_in_any_case(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "Documents" / "mpsd").mkdir(parents=True)
    link = tmp_path / "short"
    link.symlink_to(home / "Documents" / "mpsd")
    paths = [
        ("config", home / "Documents" / "mpsd" / "mpsd.yaml"),
        ("model repository", link / "models"),  # a symlink into ~/Documents: the job follows it
        ("venv python", home / "desktop" / "venv" / "bin" / "python"),  # APFS ignores case
        ("working directory", Path("/Volumes/External/mpsd")),
        ("checkout", home / "src" / "mpsd"),
    ]
    with osfacts.use(osfacts.DARWIN):
        found = privacy.protected(paths, home=home)
    assert [(p.what, p.folder) for p in found] == [
        ("config", home / "Documents"),
        ("model repository", home / "Documents"),
        ("venv python", home / "Desktop"),
        ("working directory", Path("/Volumes")),
    ]
    with osfacts.use(osfacts.LINUX):  # Linux has no such folders
        assert privacy.protected(paths, home=home) == []


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    made = Env(tmp_path)
    yield made
    kill_started(made.state)


def _config_in(env: Env, folder: Path) -> Path:
    config = folder / "mpsd.yaml"
    (folder / "models").mkdir(parents=True)
    config.write_text("drain_timeout_s: 30\n")
    return config


def test_install_refuses_a_config_in_documents_before_calling_launchctl(env: Env) -> None:
    config = _config_in(env, env.home / "Documents" / "mpsd")
    proc = env.cli("install", "--config", str(config), "--no-wait", **DARWIN)
    assert proc.returncode == 1, proc.stderr
    assert "privacy-protected folder" in proc.stderr
    assert f"config {config}" in proc.stderr and f"model repository {config.parent / 'models'}" in proc.stderr
    assert (
        "hint:" in proc.stderr
        and "Full Disk Access" in proc.stderr
        and "nothing was installed" in proc.stderr
    )
    assert env.calls() == []
    assert not env.plist.exists()


def test_install_refuses_a_python_in_downloads(env: Env, tmp_path: Path) -> None:
    python = env.home / "Downloads" / "mpsd" / ".venv" / "bin" / "python"
    proc = env.cli("install", "--config", str(env.config), "--python", str(python), "--no-wait", **DARWIN)
    assert proc.returncode == 1, proc.stderr
    assert f"venv python {python}" in proc.stderr
    assert env.calls() == []


def test_install_refuses_a_working_directory_on_a_volume(env: Env) -> None:
    work = Path("/Volumes/External/mpsd")
    proc = env.cli("install", "--config", str(env.config), "--working-dir", str(work), "--no-wait", **DARWIN)
    assert proc.returncode == 1, proc.stderr
    assert f"working directory {work}" in proc.stderr
    assert env.calls() == []


def test_install_goes_ahead_outside_the_protected_folders_or_when_allowed(env: Env) -> None:
    proc = env.cli("install", "--config", str(env.config), "--no-wait", **DARWIN)
    assert proc.returncode == 0, proc.stderr
    assert [call[0] for call in env.mutating_calls()] == ["enable", "bootstrap"]

    config = _config_in(env, env.home / "Documents" / "mpsd")
    proc = env.cli("install", "--config", str(config), "--no-wait", "--allow-protected-folders", **DARWIN)
    assert proc.returncode == 0, proc.stderr
    assert "bootstrap" in [call[0] for call in env.mutating_calls()[2:]]


def test_a_job_opens_its_checkout_interpreter_config_repository_and_working_directory(tmp_path: Path) -> None:
    """docs/service.md: install checks each of them, the working directory and mpsd's own checkout too; the
    hint names the interpreter's real file, which Full Disk Access is granted to, not the venv's link."""
    real = tmp_path / "python3.12"
    real.write_text("")
    link = tmp_path / "venv-python"
    link.symlink_to(real)
    config, repo, work = tmp_path / "mpsd.yaml", tmp_path / "models", tmp_path / "work"
    paths = privacy.service_paths(str(link), config, repo, work)
    assert paths == [
        ("checkout", privacy.checkout()),
        ("venv python", link),
        ("config", config),
        ("model repository", repo),
        ("working directory", work),
    ]
    found = [privacy.ProtectedPath("working directory", work, Path("/Volumes"))]
    said = privacy.hint(found, str(link))
    assert f"Full Disk Access to {real} " in said and "/Volumes" in said
