"""The daemon's contract with service managers: sd_notify, graceful SIGTERM, SIGHUP, exit codes; and on
macOS, the `caffeinate` child that holds off idle sleep while it serves."""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

from mpsd import osfacts
from tests import models
from tests.conftest import RunningDaemon, free_port, own_segments, pending_requests, wait_for

SLOW = """
if float(inputs['x'].sum()) > 0:
    time.sleep(2.0)
return {'y': inputs['x'] * 2}
"""


def _x(value: float) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.full(2, value, np.float32))
    return [inp]


class NotifySocket:
    """A datagram socket standing in for systemd's notification socket (this is the real protocol). Like
    systemd, it reads each message as it arrives: the daemon's send blocks once a few unread datagrams are
    queued (net.unix.max_dgram_qlen, 10 by default), which a daemon slow to start on a loaded machine,
    pinging its watchdog every 0.2 s, would reach while the test waits for it to be live."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[str] = []
        self._closing = threading.Event()
        self._reader = threading.Thread(target=self._read, name="notify-socket", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while not self._closing.is_set():
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> None:
        self._closing.set()
        self._reader.join()
        self.sock.close()

    def drain(self) -> list[str]:
        return list(self.messages)

    def seen(self, text: str) -> bool:
        return any(text in m for m in self.drain())


def test_sd_notify_ready_reload_stopping_and_watchdog(
    tmp_path: Path, sock_dir: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo)
    notify = NotifySocket(sock_dir / "notify.sock")
    daemon = start_daemon(repo, env={"NOTIFY_SOCKET": str(notify.path), "WATCHDOG_USEC": "400000"})
    daemon.wait_live()
    wait_for(lambda: notify.seen("READY=1"), 120, "READY=1")
    assert daemon.client.is_server_ready()
    assert any("STATUS=" in m for m in notify.messages)
    wait_for(lambda: sum("WATCHDOG=1" in m for m in notify.drain()) >= 3, 30, "watchdog pings")
    count_ready = sum("READY=1" in m for m in notify.messages)
    os.kill(daemon.pid, signal.SIGHUP)
    wait_for(lambda: notify.seen("RELOADING=1"), 30, "RELOADING=1")
    reloading = next(m for m in notify.messages if "RELOADING=1" in m)
    assert "MONOTONIC_USEC=" in reloading
    wait_for(lambda: sum("READY=1" in m for m in notify.drain()) > count_ready, 30, "READY=1 after reload")
    # Workers must not inherit the daemon's notification socket.
    for pid in daemon.worker_pids():
        assert "NOTIFY_SOCKET" not in psutil.Process(pid).environ()
    assert daemon.stop() == 0
    wait_for(lambda: notify.seen("STOPPING=1"), 10, "STOPPING=1")
    notify.close()


def test_sigterm_drains_in_flight_requests_and_cleans_up(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    models.python_model(repo, "slow", SLOW)
    metrics = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(repo, extra_args=["--metrics-address", metrics])
    daemon.wait_ready()
    workers = daemon.worker_pids()
    assert workers
    results: list[object] = []

    def call() -> None:
        client = grpcclient.InferenceServerClient(daemon.address)
        try:
            results.append(client.infer("slow", _x(1.0)).as_numpy("y").tolist())
        except InferenceServerException as exc:
            results.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    wait_for(lambda: pending_requests(metrics) == 2, 30, "both requests in the daemon")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "stopping: draining in-flight requests" in daemon.log(), 30, "the drain begun")
    late = grpcclient.InferenceServerClient(daemon.address)
    refused: InferenceServerException | None = None
    try:
        late.infer("slow", _x(0.0))
    except InferenceServerException as exc:
        refused = exc
    finally:
        late.close()
    for t in threads:
        t.join()
    assert results == [[2.0, 2.0], [2.0, 2.0]]
    assert refused is not None, "a request during the drain was accepted"
    assert daemon.proc.wait(60) == 0
    wait_for(lambda: not any(psutil.pid_exists(p) for p in workers), 10, "workers gone")
    assert own_segments(daemon) == set()


def test_kill_9_of_the_daemon_leaves_no_worker(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    models.add_sub(repo)
    daemon = start_daemon(repo)
    daemon.wait_ready()
    workers = daemon.worker_pids()
    assert workers
    os.kill(daemon.pid, signal.SIGKILL)
    daemon.proc.wait(10)

    def all_gone() -> bool:
        return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers)

    wait_for(all_gone, 10, "workers to notice the daemon died")


# ---- macOS: idle sleep held off while serving ------------------------------------------------------------
# The daemon holds off idle sleep with a `caffeinate -i -w <its pid>` child, ended at shutdown. Darwin's
# facts are injected into a real daemon (MPSD_OS_FACTS), and a fake `caffeinate` first on PATH records how
# it was started and waits.

CAFFEINATE_EVENT = "keeping the Mac from idle sleep while serving"


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
    assert CAFFEINATE_EVENT in daemon.log()
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
    assert CAFFEINATE_EVENT not in daemon.log()
    assert caffeinates(daemon.pid, bin_dir) == []
    assert not record.exists()
