"""Front processes' parts that need no running fronts, and so run on every platform (test_fronts.py holds
the shared-port tests, Linux only): how many fronts a setting asks for, the frames and buffers of the link
to the daemon, the event loop check, a front left without a daemon, stale socket folders."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import ROOT


def write_config(path: Path, **settings: object) -> Path:
    path.write_text(yaml.safe_dump({"metrics_address": "", **settings}))
    return path


def test_a_frame_is_its_pieces_behind_a_header_that_counts_their_bytes() -> None:
    """No empty piece (asyncio's scatter-gather writelines would poll the socket forever with one left at
    the end), and the length is in bytes even for views of wider items."""
    from mpsd.ipc.front_wire import HEADER, Kind, frame, frame_of

    wide = memoryview(np.arange(5, dtype=np.float32).tobytes()).cast("f")  # len() is 5, 20 bytes
    parts = frame_of(Kind.REPLY, 7, 0.0, [b"", b"ab", wide, memoryview(b""), bytearray(b"c")])
    assert all(memoryview(p).nbytes for p in parts)
    kind, call_id, _, length = HEADER.unpack(parts[0])
    assert (kind, call_id, length) == (Kind.REPLY, 7, 23)
    assert b"".join(parts[1:]) == b"ab" + wide.tobytes() + b"c"
    assert len(frame(Kind.CANCEL, 3)) == 1  # a header alone


def test_link_sockets_ask_for_buffers_that_hold_a_large_frame() -> None:
    from mpsd.ipc.front_wire import SOCKET_BUFFER, widen_buffers

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with ours, theirs:
        before = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        reported = widen_buffers(ours)
        after = ours.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert reported == after  # what the daemon compares with what it asked for
    cap = Path("/proc/sys/net/core/wmem_max")
    if cap.exists():  # Linux reports twice what it grants, up to twice the cap
        assert after >= min(2 * SOCKET_BUFFER, 2 * int(cap.read_text()))
    assert after > before


def test_uvloop_where_it_is_not_installed_is_a_configuration_error(monkeypatch: pytest.MonkeyPatch) -> None:
    from mpsd.errors import ConfigError
    from mpsd.net import eventloop

    monkeypatch.setitem(sys.modules, "uvloop", None)  # `import uvloop` now fails as if it were not installed
    eventloop.check("asyncio")
    with pytest.raises(ConfigError, match="uvloop is not installed"):
        eventloop.check("uvloop")


@pytest.mark.parametrize(
    ("setting", "address", "cpus", "platform", "expected"),
    [
        ("auto", "127.0.0.1:8001", 2, "linux", 0),
        ("auto", "127.0.0.1:8001", 4, "linux", 0),
        ("auto", "127.0.0.1:8001", 6, "linux", 3),
        ("auto", "127.0.0.1:8001", 8, "linux", 4),
        ("auto", "0.0.0.0:8001", 16, "linux", 8),
        ("auto", "127.0.0.1:8001", 64, "linux", 8),
        ("auto", "127.0.0.1:8001", 16, "darwin", 0),
        ("auto", "unix:///tmp/mpsd.sock", 16, "linux", 0),
        (0, "127.0.0.1:8001", 16, "darwin", 0),
        (3, "127.0.0.1:8001", 2, "linux", 3),
    ],
)
def test_how_many_fronts(setting: object, address: str, cpus: int, platform: str, expected: int) -> None:
    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.daemon.supervise.fronts.policy import front_count

    config = DaemonConfig(front_processes=setting, grpc_address=address)  # type: ignore[arg-type]
    assert front_count(config, cpu_count=cpus, platform=platform) == expected


def test_auto_counts_the_cpus_the_daemon_may_use_not_the_machines(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon pinned to 3 cores of a 16-core machine (taskset, CPUAffinity=) runs no fronts, as on a
    3-core machine; pinned to 8 of them, four."""
    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.daemon.supervise.fronts import policy

    config = DaemonConfig(front_processes="auto", grpc_address="127.0.0.1:8001")
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert policy.front_count(config, platform="linux") == 0
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert policy.front_count(config, platform="linux") == 4


def test_loops_poll_by_default_only_without_fronts_and_as_set_whenever_set() -> None:
    """Left to its default, busy polling is off where fronts run (the daemon reads a few links, many
    requests at a time) and on where the daemon serves gRPC itself; a value the operator sets is kept."""
    from mpsd import osfacts
    from mpsd.config.daemon_config import DaemonConfig
    from mpsd.daemon.supervise.fronts.policy import busy_poll_us

    with osfacts.use(osfacts.LINUX):
        default = DaemonConfig()
        assert busy_poll_us(default, fronts=0) == 200
        assert busy_poll_us(default, fronts=4) == 0
        for value in (0, 150, 200):
            assert busy_poll_us(DaemonConfig(busy_poll_us=value), fronts=4) == value
            assert busy_poll_us(DaemonConfig(busy_poll_us=value), fronts=0) == value


def test_an_explicit_count_on_macos_is_refused_and_the_setting_survives_the_trip_to_a_front(
    tmp_path: Path,
) -> None:
    from mpsd.config.daemon_config import DaemonConfig, load_daemon_config
    from mpsd.daemon.supervise.fronts.policy import front_count
    from mpsd.errors import ConfigError

    with pytest.raises(ConfigError, match="only on Linux"):
        front_count(DaemonConfig(front_processes=2), cpu_count=16, platform="darwin")
    for value in ("auto", 0, 4):
        config = load_daemon_config(write_config(tmp_path / f"{value}.yaml", front_processes=value))
        assert config.front_processes == value
        # what a front receives: the daemon's settings as JSON
        assert DaemonConfig.model_validate(config.model_dump(mode="json")).front_processes == value
    with pytest.raises(ConfigError, match="front_processes"):
        load_daemon_config(write_config(tmp_path / "bad.yaml", front_processes="many"))


def test_a_front_whose_daemon_is_gone_before_it_was_told_what_to_serve_exits() -> None:
    daemon_end, front_end = socket.socketpair()
    front = subprocess.Popen(
        [sys.executable, "-m", "mpsd.front", "--fd", str(front_end.fileno())],
        pass_fds=(front_end.fileno(),),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )
    front_end.close()
    daemon_end.close()
    assert front.wait(30) == 1


def test_socket_directories_of_dead_daemons_are_removed(
    monkeypatch: pytest.MonkeyPatch, sock_dir: Path
) -> None:
    from mpsd.daemon.supervise.fronts import sockets

    tmp_path = sock_dir  # short: it holds socket paths
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"mpsd-daemon-{gone.pid}-abc"
    stale.mkdir()
    (stale / "daemon.sock").touch()
    alive = tmp_path / f"mpsd-daemon-{os.getppid()}-def"  # our parent is running
    alive.mkdir()
    mine = sockets.make_socket_dir()
    assert mine.parent == tmp_path and oct(mine.stat().st_mode & 0o777) == "0o700"
    assert sockets.remove_stale_socket_dirs() == [stale.name]
    assert not stale.exists() and alive.exists() and mine.exists()


def test_usable_cpus_are_the_affinity_and_every_cpu_where_macos_has_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One count for fronts and workers (`osfacts.usable_cpus`): a process's affinity on Linux; macOS has no
    `os.sched_getaffinity` (its fact injected here by removing it), so there every CPU of the machine."""
    from mpsd import osfacts

    monkeypatch.setattr(osfacts.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(osfacts.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert osfacts.usable_cpus() == 3
    monkeypatch.delattr(osfacts.os, "sched_getaffinity")
    assert osfacts.usable_cpus() == 16
