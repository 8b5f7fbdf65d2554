"""The suite itself on a Mac, with macOS's facts put in force here (`mpsd.osfacts`):

- Unix sockets go in short folders of /tmp that hold a socket path within macOS's 104 bytes, even under a
  61-character TMPDIR (xdist's folders under a Mac's TMPDIR are what made tmp_path too long);
- clients' shared-memory objects are found and removed by name, never through /dev/shm, and their names fit
  macOS's 31 characters; the test that shrinks one skips where an object is sized once;
- tests of what only Linux has skip with darwin's facts in force, saying why, rather than fail; the tools'
  install hints name the system's own package manager.
"""

from __future__ import annotations

import _posixshmem
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from mpsd import osfacts
from tests import os_skips, posix_shm
from tests.conftest import ROOT, SOCKET_NAME_MAX, short_socket_dir

LONG_TMPDIR = 61  # a TMPDIR one character over the 60 up to which mpsd puts its own sockets in TMPDIR


@pytest.fixture
def long_tmpdir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """TMPDIR (and tempfile's idea of it) set to an existing folder whose path is 61 characters."""
    base = Path(tempfile.mkdtemp(prefix="mpsd-long-tmpdir-", dir="/tmp"))
    path = base / ("x" * (LONG_TMPDIR - len(str(base)) - 1))
    path.mkdir()
    assert len(str(path)) == LONG_TMPDIR
    monkeypatch.setenv("TMPDIR", str(path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # asked again from the environment
    assert tempfile.gettempdir() == str(path)
    yield path
    shutil.rmtree(base)


def test_a_socket_folder_holds_a_socket_path_on_macos_under_a_long_tmpdir(
    long_tmpdir: Path, request: pytest.FixtureRequest
) -> None:
    """The longest path a test puts in its socket folder fits macOS's sun_path, NUL included, and binds."""
    sock_dir: Path = request.getfixturevalue("sock_dir")  # made now, under the long TMPDIR
    deepest = sock_dir / ("s" * SOCKET_NAME_MAX)
    assert len(os.fsencode(deepest)) + 1 <= osfacts.DARWIN.unix_path_max, deepest
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(deepest))
    assert deepest.exists()


def test_a_socket_folder_is_private_and_removed_with_its_sockets() -> None:
    with short_socket_dir() as folder:
        assert folder.stat().st_mode & 0o777 == 0o700
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(str(folder / "notify.sock"))
    assert not folder.exists()


def _refusing_dev_shm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make any look at /dev/shm through os fail, as it would find nothing on a Mac."""

    def guard(call: Callable[..., Any]) -> Callable[..., Any]:
        def guarded(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, (str, os.PathLike)) and os.fspath(path).startswith("/dev/shm"):
                raise AssertionError(f"looked in /dev/shm: {path}")
            return call(path, *args, **kwargs)

        return guarded

    for name in ("stat", "lstat", "unlink", "remove", "listdir", "scandir", "open"):
        monkeypatch.setattr(os, name, guard(getattr(os, name)))


def test_shared_memory_objects_are_found_and_removed_by_name_without_dev_shm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    key = posix_shm.checked(f"/mpsdt_{os.getpid()}_found")
    try:
        with monkeypatch.context() as patched, osfacts.use(osfacts.DARWIN):
            _refusing_dev_shm(patched)
            assert not posix_shm.exists(key)
            os.close(_posixshmem.shm_open(key, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600))
            assert posix_shm.exists(key)
            posix_shm.unlink(key)
            assert not posix_shm.exists(key)
            posix_shm.unlink(key)  # already gone: nothing to do
        with pytest.raises(FileNotFoundError):  # gone for the system too, not only for the helper
            _posixshmem.shm_open(key, os.O_RDONLY, 0)
    finally:
        with contextlib.suppress(FileNotFoundError):
            _posixshmem.shm_unlink(key)


def test_names_longer_than_macos_takes_are_caught_here() -> None:
    assert posix_shm.checked("/" + "n" * 30) == "/" + "n" * 30
    with pytest.raises(AssertionError, match="31"):
        posix_shm.checked("/" + "n" * 31)


def test_shrinking_an_object_skips_where_an_object_is_sized_once() -> None:
    with osfacts.use(osfacts.DARWIN):
        reason = posix_shm.resize_refusal()
    assert reason is not None and "one ftruncate" in reason
    with osfacts.use(osfacts.LINUX):
        assert posix_shm.resize_refusal() is None


def test_linux_only_marks_and_install_hints_follow_the_facts_in_force() -> None:
    with osfacts.use(osfacts.DARWIN):
        assert not os_skips.on_linux()
        for mark in (os_skips.linux_only("reads /proc"), os_skips.shared_port_fronts()):
            assert mark.args == (True,) and mark.kwargs["reason"].startswith("Linux only: ")
        hint = os_skips.not_installed("haproxy")
    assert "brew install" in hint and "apt" not in hint, hint
    with osfacts.use(osfacts.LINUX):
        assert os_skips.on_linux()
        assert os_skips.shared_port_fronts().args == (False,)
        assert "apt-get install" in os_skips.not_installed("haproxy")


def test_linux_only_tests_skip_and_say_why_with_darwins_facts_in_force() -> None:
    """What used to error on a Mac (front processes sharing a port, /proc) is skipped there, with a reason."""
    nodes = [
        "tests/test_fronts.py",
        "tests/test_shutdown.py::test_a_start_that_fails_half_way_ends_the_daemon_with_70_and_nothing_left",
        "tests/test_http_bad_requests.py::test_failed_requests_leave_no_shared_memory_region_held",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-p", "no:xdist", *nodes],
        cwd=ROOT,
        env={**os.environ, **osfacts.child_env(osfacts.DARWIN)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = run.stdout.strip().splitlines()[-1]
    assert run.returncode == 0 and " skipped" in summary, run.stdout[-3000:] + run.stderr[-2000:]
    assert not any(word in summary for word in ("passed", "failed", "error")), summary
    reasons = [line for line in run.stdout.splitlines() if line.startswith("SKIPPED")]
    assert reasons and all("Linux only: " in line for line in reasons), reasons
