"""One worker's operating-system process: exec'd (never forked) with its two sockets, every line it prints
turned into a log event, stopped (ask, TERM, then KILL) and reaped, its end described as operators read it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import structlog

from mpsd.daemon.dataplane.arenas import ARENAS
from mpsd.daemon.supervise.child_output import output_lines
from mpsd.ipc import protocol as p
from mpsd.ipc.front_wire import widen_buffers

log = structlog.get_logger("mpsd.daemon.worker")


def describe_exit(returncode: int | None) -> str:
    """`exit code 3` / `killed by signal 9 (SIGKILL)`, as operators read it."""
    if returncode is None:
        return "ended (status unknown)"
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {-returncode} ({name})"
    return f"exit code {returncode}"


@dataclass(frozen=True)
class WorkerLaunch:
    """Everything needed to start one worker for one instance of one model version."""

    model: p.ModelSpec
    instance: int
    kind: str
    memory_fraction: float | None
    env: Mapping[str, str]
    max_device_memory_bytes: int | None = None
    max_rss_bytes: int | None = None
    gpu: int | None = None  # pinned: its index among the daemon's GPUs (the worker sees only it, as cuda:0)
    accelerator: str | None = (
        None  # "mps": Triton's mps accelerator (an unpinned KIND_GPU or KIND_AUTO group)
    )

    @property
    def label(self) -> str:
        return f"{self.model.name}/{self.model.version}#{self.instance}"


def request_pair() -> tuple[socket.socket, socket.socket]:
    """The request channel's two ends, each with the front links' buffers: macOS's default of 8 KiB would
    take hundreds of sends for a Python model's inline tensors or a 1 MiB profile chunk."""
    ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for end in ends:
        widen_buffers(end)
    return ends


class Process:
    """The worker's process as the operating system sees it; `launch` says what to run, and names it in
    logs."""

    def __init__(self, launch: WorkerLaunch) -> None:
        self.launch = launch
        self.pid: int | None = None
        self.returncode: int | None = None
        self._proc: asyncio.subprocess.Process | None = None
        self._pumps: list[asyncio.Task[None]] = []
        self.arenas: tuple[p.ArenaRef, ...] = ()  # the fronts' arenas it inherited (`arenas.ARENAS`)

    @property
    def started(self) -> bool:
        return self._proc is not None

    async def spawn(self) -> tuple[socket.socket, socket.socket]:
        """Exec the worker; returns the daemon's ends of its two sockets: a stream for the protocol's frames
        and a datagram socket for heartbeats.

        Heartbeats have a channel of their own: the worker's main thread is then the only writer of its
        stream socket and sends without a lock; a datagram is one beat, whole or not at all.
        """
        parent_sock, child_sock = request_pair()
        beats, child_beats = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.arenas = tuple(ARENAS.refs())
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mpsd.worker",
                "--fd",
                str(child_sock.fileno()),
                "--beat-fd",
                str(child_beats.fileno()),
                "--parent-pid",
                str(os.getpid()),
                pass_fds=(child_sock.fileno(), child_beats.fileno(), *(ref.fd for ref in self.arenas)),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(self.launch.env),
            )
        except BaseException:
            beats.close()
            raise
        finally:
            child_sock.close()
            child_beats.close()
        self.pid = self._proc.pid
        return parent_sock, beats

    def pump_output(self) -> None:
        """Log what the worker prints from now on."""
        assert self._proc is not None and self._proc.stdout is not None and self._proc.stderr is not None
        self._pumps.append(asyncio.create_task(self._pump_output(self._proc.stdout, "stdout")))
        self._pumps.append(asyncio.create_task(self._pump_output(self._proc.stderr, "stderr")))

    async def _pump_output(self, stream: asyncio.StreamReader, name: str) -> None:
        """Every line a worker prints becomes a log event tagged with its model and pid."""
        level = log.info if name == "stdout" else log.warning

        def too_long() -> None:
            log.warning("worker output line too long; dropped", worker=self.launch.label, pid=self.pid)

        async for text in output_lines(stream, too_long):
            level(
                text,
                source=f"worker.{name}",
                worker=self.launch.label,
                model=self.launch.model.name,
                version=self.launch.model.version,
                pid=self.pid,
            )

    def kill_now(self) -> None:
        """SIGKILL, unless it has ended already; its end is seen as any other."""
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    async def wait_exit(self, timeout_s: float | None) -> bool:
        """Reap it; False when it is still running after `timeout_s`."""
        if self._proc is None:
            return True
        try:
            self.returncode = await asyncio.wait_for(self._proc.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def kill(self) -> None:
        """SIGKILL and reap."""
        if self._proc is not None:
            self.kill_now()
            self.returncode = await self._proc.wait()

    async def stop(self, ended: asyncio.Event, timeout_s: float) -> None:
        """Wait for `ended` (the worker was asked to exit), then TERM, then KILL if it does not."""
        assert self._proc is not None
        for sig, wait in ((None, timeout_s), (signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            if sig is not None and self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(sig)
            try:
                await asyncio.wait_for(asyncio.shield(ended.wait()), wait)
                break
            except TimeoutError:
                continue
