"""Fixtures that start the real daemon on loopback, with real worker processes, and talk to it with the
stock tritonclient."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tritonclient.grpc as grpcclient

ROOT = Path(__file__).resolve().parent.parent


def _one_gpu() -> dict[str, str]:
    """On a machine of several CUDA GPUs, test daemons see the first only: a GPU (or the default, KIND_AUTO)
    model there gets one instance per GPU, and tests count one worker per model. Tests of that spread pass
    their own CUDA_VISIBLE_DEVICES. Elsewhere (CI has no GPU) the environment is left as it is."""
    from mpsd.daemon.supervise.gpus import cuda_gpu_count

    return {"CUDA_VISIBLE_DEVICES": "0"} if cuda_gpu_count(os.environ) > 1 else {}


DAEMON_GPUS = _one_gpu()


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now and never handed out before in this test run: two calls in a row (a
    daemon's gRPC port and its metrics port) can otherwise get the same port back from the kernel."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def serve_command(repo: Path, address: str) -> list[str]:
    """`mpsd serve` on `repo` and the gRPC `address`, run by this interpreter: what every test daemon runs."""
    return [sys.executable, "-m", "mpsd", "serve", "--model-repository", str(repo), "--grpc-address", address]


def _soft_open_files(soft: int) -> Any:
    """A daemon that starts with this soft open-file limit (macOS starts processes with 256)."""

    def limit() -> None:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


class RunningDaemon:
    """A real `mpsd serve` process in its own process group, with its log captured to a file."""

    def __init__(
        self,
        repo: Path,
        log_path: Path,
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        config: Path | None = None,
        shutdown_grace: float | None = 0.0,
        port: int | None = None,
        open_files_soft: int | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        self.repo = repo
        self.port = port if port is not None else free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.http_address = f"127.0.0.1:{free_port()}"  # every daemon its own HTTP port, unless given
        self.log_path = log_path
        args = serve_command(repo, self.address)
        if launcher is not None:  # what runs `serve` instead of `python -m mpsd` (a wrapper around it)
            args[:3] = launcher
        if config is not None:
            args += ["--config", str(config)]
        if shutdown_grace is not None:  # tests stop many daemons: no grace unless asked (None: config's)
            args += ["--shutdown-grace", str(shutdown_grace)]
        args += extra_args or []
        if "--http-address" in args:
            self.http_address = args[len(args) - 1 - args[::-1].index("--http-address") + 1]
        else:
            args += ["--http-address", self.http_address]
        self._log = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **DAEMON_GPUS, **(env or {})},
            start_new_session=True,
            cwd=ROOT,
            preexec_fn=_soft_open_files(open_files_soft) if open_files_soft is not None else None,
        )
        self.client = grpcclient.InferenceServerClient(self.address)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_live(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if self.client.is_server_live(client_timeout=10):
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"daemon not live after {timeout}s:\n{self.log()}")

    def wait_ready(self, timeout: float = 120) -> None:
        self.wait_live(timeout)
        wait_for(lambda: self.client.is_server_ready(), timeout, f"server ready\n{self.log()}")

    def wait_models_settled(self, timeout: float = 120) -> None:
        """Until no model is LOADING (broken ones become UNAVAILABLE)."""
        self.wait_live(timeout)

        def settled() -> bool:
            index = self.client.get_model_repository_index(as_json=True).get("models", [])
            return bool(index) and all(m.get("state") != "LOADING" for m in index)

        wait_for(settled, timeout, f"models settled\n{self.log()}")

    def started_workers(self, model: str) -> list[int]:
        """Pids of the workers the daemon logged as started for `model`, oldest first."""
        pids = []
        for line in self.log().splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "worker started" and str(event.get("worker", "")).startswith(
                f"{model}/"
            ):
                pids.append(int(event["pid"]))
        return pids

    def worker_pids(self) -> list[int]:
        import psutil

        from mpsd.daemon.supervise.fronts.pool import is_front_command

        def is_front(child: psutil.Process) -> bool:
            try:
                return is_front_command(child.cmdline())
            except psutil.Error:
                return False

        try:  # model workers only: front processes (`front_processes`) are children too
            return [c.pid for c in psutil.Process(self.pid).children(recursive=True) if not is_front(c)]
        except psutil.NoSuchProcess:
            return []

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.client.close()
        self._log.close()
        return self.proc.returncode

    def kill_group(self) -> None:
        """Last-resort cleanup: nothing the test started may outlive it."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(repo: Path, log_path: Path, **kwargs: object) -> Iterator[RunningDaemon]:
    """A daemon for a whole module: started, ready, and stopped (with its process group) at the end."""
    daemon = RunningDaemon(repo, log_path, **kwargs)  # type: ignore[arg-type]
    try:
        daemon.wait_ready()
        yield daemon
    finally:
        daemon.stop()
        daemon.kill_group()


def wait_for(predicate, timeout: float, what, interval: float = 0.1):  # type: ignore[no-untyped-def]
    """`predicate()` once it is true; `what` (or what it returns, when callable: a daemon's log read at the
    timeout rather than at the start) names the wait when it times out."""
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:
            last = exc
        time.sleep(interval)
    raise TimeoutError(f"timed out waiting for {what() if callable(what) else what} (last error: {last})")


# A Unix socket's path must fit sockaddr_un.sun_path: 104 bytes on macOS, the NUL included. pytest's tmp_path
# does not: a Mac's $TMPDIR (/private/var/folders/xx/<30>/T) with pytest-of-USER/pytest-N and, under xdist,
# popen-gwN/<test name> is over 130 bytes. Tests put their sockets in a short folder of /tmp instead.
SOCKET_ROOT = "/tmp"
# The longest path a test puts under such a folder: a socket's name, or a daemon's own socket folder
# (mpsd-daemon-<pid>-<8>/daemon.sock) where the folder stands in for XDG_RUNTIME_DIR.
SOCKET_NAME_MAX = 48


@contextlib.contextmanager
def short_socket_dir() -> Iterator[Path]:
    """A new private folder for Unix sockets under /tmp, whatever $TMPDIR is; removed with its contents."""
    path = Path(tempfile.mkdtemp(prefix="mpsdt-", dir=SOCKET_ROOT))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    """A short folder for the test's Unix sockets (SOCKET_ROOT): tmp_path is too long for them on macOS."""
    with short_socket_dir() as path:
        yield path


@pytest.fixture(scope="module")
def module_sock_dir() -> Iterator[Path]:
    """sock_dir for a module's shared daemons."""
    with short_socket_dir() as path:
        yield path


@pytest.fixture
def start_daemon(tmp_path: Path) -> Iterator[object]:
    """Factory: start_daemon(repo, ...) -> RunningDaemon; every daemon is stopped at teardown."""
    started: list[RunningDaemon] = []

    def _start(repo: Path, **kwargs: object) -> RunningDaemon:
        daemon = RunningDaemon(repo, tmp_path / f"daemon{len(started)}.log", **kwargs)  # type: ignore[arg-type]
        started.append(daemon)
        return daemon

    yield _start
    for daemon in started:
        daemon.stop()
        daemon.kill_group()


def shm_segments() -> set[str]:
    """mpsd's shared-memory segments present now: /dev/shm's listing on Linux; on macOS, which lists none,
    the names daemons record (in their runtime dir), each asked of the system (shm_open)."""
    from mpsd.ipc import shm

    return set(shm.list_segments())


def own_segments(daemon: RunningDaemon) -> set[str]:
    """Shared-memory segments created by this daemon (named after its pid): other daemons on the machine,
    another test run's too, do not count."""
    return {s for s in shm_segments() if s.startswith(f"mpsd-{daemon.pid}-")}


def pending_requests(metrics_address: str) -> float:
    """Requests the daemon holds (queued or running), from its pending gauge: what a test waits on before it
    cancels, signals or removes something, so the request is known to be in the daemon."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("mpsd_inference_pending_request_count{")
    )


def http_request(
    address: str,
    method: str,
    path: str,
    body: bytes = b"",
    headers: dict[str, str] | None = None,
    timeout: float = 30,
) -> tuple[int, Any, bytes]:
    """One plain HTTP/1.1 request: (status, the body as JSON where it is JSON, else None, the raw body)."""
    import http.client

    host, _, port = address.rpartition(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        connection.request(method, path, body=body, headers=headers or {})
        response = connection.getresponse()
        data = response.read()
        parsed = None
        if (response.getheader("Content-Type") or "").startswith("application/json") and data:
            parsed = json.loads(data)
        return response.status, parsed, data
    finally:
        connection.close()
