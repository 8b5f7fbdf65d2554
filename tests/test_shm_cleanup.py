"""Shared memory left by a daemon killed with -9 is unlinked by the next one, on macOS too, where no folder
lists shared memory: each daemon records the names it holds in its runtime dir, and names carry a random
tag, within macOS's 31 characters. macOS's facts are put in force (in-process, or MPSD_OS_FACTS=darwin in a
daemon's environment); whether a segment exists is asked of the system itself (shm_open)."""

from __future__ import annotations

import _posixshmem
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient

from mpsd import osfacts
from mpsd.ipc import shm
from mpsd.ipc.shm_record import RECORD_PREFIX
from tests import models, posix_shm
from tests.conftest import ROOT, RunningDaemon, own_segments, shm_segments, wait_for


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A runtime dir of this test's own (short: a longer one is not taken), for this process and the
    daemons it starts."""
    where = Path(tempfile.mkdtemp(prefix="mpsd-rt-", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(where))
    yield where
    shutil.rmtree(where, ignore_errors=True)


def exists(name: str) -> bool:
    """A segment named as mpsd records it (with or without its slash), asked of the system."""
    return posix_shm.exists("/" + name.lstrip("/"))


def test_the_longest_name_fits_macos() -> None:
    """Linux's largest pid (7 digits), the tag, and the largest count a name spells (10 hex digits)."""
    longest = shm.format_name(4_194_304, "f" * len(shm.TAG), 16**10 - 1)
    assert len(longest) == osfacts.DARWIN.shm_name_max, longest
    region = shm.Region(longest, 4096, create=True)
    try:
        assert exists(longest)
    finally:
        region.unlink()
        region.close()
    assert shm.new_name().startswith(f"/mpsd-{os.getpid()}-{shm.TAG}-")


def test_a_dead_processs_recorded_names_are_found_and_unlinked_on_macos(runtime: Path) -> None:
    """A process that recorded a segment and died without cleaning up (os._exit: as kill -9 would): with
    no /dev/shm to list, the record is what finds it, for the tests' leak check and for cleanup."""
    script = (
        "import os\nfrom mpsd.ipc import shm\nshm.keep_record()\n"
        "region = shm.Region.create(4096)\nprint(region.name.lstrip('/'), flush=True)\nos._exit(0)\n"
    )
    env = {**os.environ, **osfacts.child_env(osfacts.DARWIN)}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    name = done.stdout.strip()
    try:
        assert exists(name)
        with osfacts.use(osfacts.DARWIN):
            assert name in shm_segments()
            assert shm.cleanup_stale() == [name]
            assert name not in shm_segments()
        with pytest.raises(FileNotFoundError):
            _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
        assert list(runtime.iterdir()) == []  # the record went with its names
    finally:
        if exists(name):
            _posixshmem.shm_unlink("/" + name)


def test_at_exit_a_daemon_unlinks_its_recorded_names_and_removes_its_record(runtime: Path) -> None:
    with osfacts.use(osfacts.DARWIN):
        record = shm.keep_record()
        region = shm.Region.create(4096)
        name = region.name.lstrip("/")
        try:
            assert record.read_text().split() == [region.name]
            assert shm.cleanup_own() == [name]
        finally:
            region.unlink()
            region.close()
    assert not exists(name)
    assert not record.exists()


def held_model(repo: Path, started: Path) -> None:
    """`y = x + 1`; a large input (never the warm-up's) first touches `started`, then is held forever."""
    models.python_model(
        repo,
        "held",
        f"""
        if inputs['x'].numel() > 1000:
            open({str(started)!r}, 'w').close()
            while True:
                time.sleep(1)
        return {{'y': inputs['x'] + 1}}
        """,
    )


def test_a_daemon_killed_with_9_leaves_shared_memory_the_next_one_unlinks_on_macos(
    start_daemon, runtime: Path, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A 2 MiB request outgrows the worker's first region, so a new one is named while it is held; the daemon
    is killed with -9 then. The next daemon, with macOS's facts (nothing listed in /dev/shm), unlinks it."""
    repo = tmp_path / "repo"
    started = tmp_path / "started"
    held_model(repo, started)
    env = {"XDG_RUNTIME_DIR": str(runtime), **osfacts.child_env(osfacts.DARWIN)}
    first: RunningDaemon = start_daemon(repo, env=env)
    first.wait_ready()
    x = grpcclient.InferInput("x", [1 << 19], "FP32")
    x.set_data_from_numpy(np.ones(1 << 19, np.float32))
    failed: list[object] = []  # the request's error, should it end before the kill
    first.client.async_infer("held", [x], callback=lambda result, error: failed.append(error))
    wait_for(lambda: started.exists() or failed, 60, "the request to reach the worker")
    assert started.exists(), f"the request ended before reaching the worker: {failed}"
    with osfacts.use(osfacts.DARWIN):
        left = own_segments(first)
    assert left, "the new region is named while the worker holds the request"
    first.kill_group()
    first.proc.wait()
    try:
        assert all(exists(name) for name in left)
        assert (runtime / f"{RECORD_PREFIX}{first.pid}").exists()
        second: RunningDaemon = start_daemon(repo, env=env)
        second.wait_live()
        # The record goes once its names are unlinked. (Not the log line: on Linux a daemon another test
        # starts meanwhile may unlink the dead daemon's segments first, from its /dev/shm listing.)
        record = runtime / f"{RECORD_PREFIX}{first.pid}"
        wait_for(lambda: not record.exists(), 60, "the cleanup at start")
        for name in left:
            with pytest.raises(FileNotFoundError):
                _posixshmem.shm_open("/" + name, os.O_RDONLY, 0)
        assert not (runtime / f"{RECORD_PREFIX}{first.pid}").exists()
    finally:
        for name in left:
            if exists(name):
                _posixshmem.shm_unlink("/" + name)
