"""Starts, supervises and stops the front processes (see the package's docstring for what they are)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import structlog

from mpsd import logs
from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.security import AuthConfig, Token
from mpsd.daemon.dataplane.arenas import ARENAS
from mpsd.daemon.supervise.fronts.link import FrontCounts, FrontFailed, FrontLink, InferBytes, Submit
from mpsd.daemon.supervise.fronts.policy import front_address
from mpsd.daemon.supervise.fronts.relay import LOG_LINE_LIMIT, relay_front_log
from mpsd.daemon.supervise.launch import worker_base_env
from mpsd.daemon.supervise.restart import Backoff
from mpsd.ipc.front_protocol import FRONT_TITLE, ArenaRegion, FrontAccess, FrontConfig
from mpsd.ipc.front_wire import SOCKET_BUFFER, Buffer, Kind, frame, widen_buffers
from mpsd.ipc.shm import Region
from mpsd.net import eventloop
from mpsd.net.auth import export_tokens
from mpsd.net.certificates import TlsMaterial
from mpsd.net.listen import parse_address
from mpsd.net.tasks import TaskGroup

log = structlog.get_logger("mpsd.daemon.supervise.fronts")
FRONT_MODULE = "mpsd.front"  # what a front process runs: `python -m FRONT_MODULE`


def is_front_command(argv: Sequence[str]) -> bool:
    """Whether a process's command line is a front process's (tools tell fronts from model workers): as
    started, or as it names itself in ps."""
    return FRONT_MODULE in argv or any(arg.startswith(FRONT_TITLE) for arg in argv)


START_TIMEOUT_S = 30.0
SMALLEST_ARENA = 4 << 20  # below this an arena holds too few large calls to be worth the shared memory


def _level_frame(level: str) -> tuple[Buffer, ...]:
    return frame(Kind.LOG_LEVEL, payload=level.encode())


@dataclass(frozen=True)
class FrontInfo:
    index: int
    pid: int
    state: str  # "listening", or "restarting" between a death and the new process listening
    requests: int  # ModelInfer calls handed to the daemon, over restarts
    restarts: int
    port: int  # the port it listens on alone (front_ports); 0: grpc_address's, shared


@dataclass
class Front:
    index: int
    process: asyncio.subprocess.Process
    link: FrontLink


class FrontPool:
    """Starts, supervises and stops the front processes: `count` sharing grpc_address's port, or one on
    each of `ports`."""

    def __init__(
        self,
        count: int,
        config: DaemonConfig,
        daemon_target: str,
        infer: InferBytes,
        tokens: Sequence[Token] = (),
        tls: TlsMaterial | None = None,
        ports: Sequence[int] = (),
        submit: Submit | None = None,
    ) -> None:
        self.ports = tuple(ports)
        self.count = len(self.ports) or count
        self._config = config
        # As the daemon read them: fronts never read token or certificate files.
        self._tokens = list(tokens)
        self._tls = tls
        self._daemon_target = daemon_target
        self._infer = infer
        self._submit = submit
        self.fronts: dict[int, Front] = {}
        self.restarts: dict[int, int] = {}
        self.counts: dict[int, FrontCounts] = {}
        self._stopping = False
        self._supervisors: list[asyncio.Task[None]] = []
        self._relays = TaskGroup()  # each front's stderr turned into log events, until it closes
        self._stop_listening: Callable[[], None] = lambda: None
        self._told_buffer_cap = False
        self._told_no_arena = False
        # Restarts follow the workers' policy (restart_backoff_initial_s doubling to restart_backoff_max_s,
        # forgiven after a stable run); the sleep and the clock are replaceable for tests.
        self._backoffs: dict[int, Backoff] = {}
        self._sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
        self._clock: Callable[[], float] = time.monotonic

    def served(self) -> dict[int, int]:
        """ModelInfer calls each front slot has handed to the daemon, over restarts."""
        return {i: self.counts[i].served for i in sorted(self.fronts)}

    def running(self) -> int:
        return sum(f.process.returncode is None for f in self.fronts.values())

    def describe(self) -> list[FrontInfo]:
        """Each front slot, for ListWorkers."""
        served = self.served()
        return [
            FrontInfo(
                i,
                f.process.pid,
                "listening" if f.process.returncode is None else "restarting",
                served.get(i, 0),
                self.restarts.get(i, 0),
                self.ports[i] if self.ports else 0,
            )
            for i, f in sorted(self.fronts.items())
        ]

    async def start(self) -> None:
        """Start every front and wait until all listen; FrontFailed (the others stopped) if one cannot."""
        self._stop_listening = logs.on_level_change(self._send_level)
        started = await asyncio.gather(*(self._spawn(i) for i in range(self.count)), return_exceptions=True)
        for i in range(self.count):
            self._backoff(i).started(self._clock())
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            await self.stop(0.0)
            raise errors[0]
        self._supervisors = [asyncio.create_task(self._supervise(i)) for i in range(self.count)]

    async def _spawn(self, index: int) -> Front:
        """Start one front and wait until it listens. On any failure, or if cancelled (the daemon
        stopping meanwhile), the process is ended and the socket closed: nothing half-started stays."""
        parent, child = self._link_sockets()
        process: asyncio.subprocess.Process | None = None
        counts = self.counts.setdefault(index, FrontCounts())
        link = FrontLink(index, self._infer, self._on_link_lost, counts=counts, submit=self._submit)
        arena = link.arena = self._arena()
        try:
            process = await self._exec_front(child)
            assert process.stderr is not None
            self._relays.spawn(relay_front_log(process.stderr, index, process.pid))
            loop = asyncio.get_running_loop()
            transport, _ = await loop.create_unix_connection(link.protocol, sock=parent)
            link.attach(transport)
            await self._configure(index, link, arena)
        except BaseException as exc:
            await _abandon(link, parent, arena, process)
            if isinstance(exc, (FrontFailed, TimeoutError)):
                reason = str(exc) or f"it did not listen within {START_TIMEOUT_S:g} s"
                raise FrontFailed(f"front process {index} could not start: {reason}") from None
            raise
        if arena is not None:
            arena.unlink()  # both ends have it mapped: the memory goes when all unmap it, however they end
            if self._config.arenas_to_workers:  # workers started from now on read requests from it in place
                link.arena_id = ARENAS.add(arena)
            else:
                arena.drop_fd()
        front = Front(index, process, link)
        self.fronts[index] = front
        log.info(
            "front listening",
            front=index,
            pid=process.pid,
            address=self.address(index),
            event_loop=link.ready.result().event_loop,
            busy_poll_us=link.ready.result().busy_poll_us,
            frozen_objects=link.ready.result().frozen_objects,
        )
        return front

    def _link_sockets(self) -> tuple[socket.socket, socket.socket]:
        """The daemon's and the front's ends of a new link, with buffers as large as the kernel grants."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        granted = min(widen_buffers(end) for end in (parent, child))
        if granted < SOCKET_BUFFER and not self._told_buffer_cap:
            self._told_buffer_cap = True  # once per daemon: every link gets the same cap
            log.info(
                "front link socket buffers capped by the kernel: large tensors take several sends",
                asked=SOCKET_BUFFER,
                granted=granted,
                hint="raise net.core.wmem_max and net.core.rmem_max (Linux) to at least the size asked",
            )
        return parent, child

    async def _exec_front(self, child: socket.socket) -> asyncio.subprocess.Process:
        """The front process, holding `child` (closed here: from now on only the front holds that end)."""
        try:
            return await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                FRONT_MODULE,
                "--fd",
                str(child.fileno()),
                "--event-loop",
                self._config.event_loop,
                "--busy-poll-us",
                str(eventloop.busy_poll_us()),  # the daemon's own loop's (`policy.busy_poll_us`)
                pass_fds=(child.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE,
                limit=LOG_LINE_LIMIT,
                env=worker_base_env(),
            )
        finally:
            child.close()

    async def _configure(self, index: int, link: FrontLink, arena: Region | None) -> None:
        """Tell a new front what to serve and wait until it listens. A SIGHUP or LogSettings while it started
        reached only the fronts already listening: what they changed is sent to this one again."""
        sent_auth, sent_tokens, sent_tls = self._config.auth, self._tokens, self._tls
        sent_level = logs.level_name()
        settings = FrontConfig(
            index,
            sent_level,  # now: LogSettings or SIGHUP may have changed it
            self._daemon_target,
            self._config.model_dump(mode="json"),
            ArenaRegion(arena.name, arena.size) if arena is not None else None,
            self._access(),
            self.address(index),
            not self.ports,
        )
        link.send(frame(Kind.CONFIG, payload=settings.encode()))
        await asyncio.wait_for(link.ready, START_TIMEOUT_S)
        changed = (self._config.auth, self._tokens, self._tls) != (sent_auth, sent_tokens, sent_tls)
        if changed:
            link.send(self._auth_frame())
        if logs.level_name() != sent_level:
            link.send(_level_frame(logs.level_name()))

    def address(self, index: int) -> str:
        """Where front `index` listens: grpc_address, shared, or a port of its own on that host."""
        if not self.ports:
            return self._config.grpc_address
        return front_address(parse_address(self._config.grpc_address), self.ports[index]).text

    def _arena(self) -> Region | None:
        """A front's arena of `front_arena_bytes`, or half as much where /dev/shm has no room for it, down to
        SMALLEST_ARENA; else None (large calls then take the socket)."""
        size = self._config.front_arena_bytes
        if size <= 0:
            return None
        failure: OSError | None = None
        while True:
            try:
                return Region.create(size, reserve=True, keep_fd=True)  # workers inherit it (`arenas`)
            except OSError as exc:
                failure = exc
            if size // 2 < SMALLEST_ARENA:
                break
            size //= 2
        if not self._told_no_arena:
            self._told_no_arena = True
            log.warning(
                "no shared memory for the front arenas: large calls go through the fronts' sockets",
                asked=self._config.front_arena_bytes,
                reason=failure.strerror or str(failure),
                hint="give /dev/shm more room (containers: --shm-size)",
            )
        return None

    def _on_link_lost(self, link: FrontLink) -> None:
        ready = link.ready
        if not self._stopping and ready.done() and not ready.cancelled() and not ready.exception():
            log.warning("front process connection lost", front=link.index)

    def _backoff(self, index: int) -> Backoff:
        if index not in self._backoffs:
            config = self._config
            self._backoffs[index] = Backoff(config.restart_backoff_initial_s, config.restart_backoff_max_s)
        return self._backoffs[index]

    async def _supervise(self, index: int) -> None:
        """Restart a front that died, with back-off, on the same port; meanwhile its clients reconnect and the
        kernel sends them to the live ones (shared port), or their channels skip it (ports of their own)."""
        backoff = self._backoff(index)
        while not self._stopping:
            front = self.fronts[index]
            code = await front.process.wait()
            if self._stopping:
                return
            backoff.ended(self._clock())
            log.error("front process exited; restarting it", front=index, pid=front.process.pid, code=code)
            if front.link.transport is not None:
                front.link.transport.close()
            self.restarts[index] = self.restarts.get(index, 0) + 1
            while not self._stopping:
                delay = backoff.delay()
                log.warning("restarting front", front=index, delay_s=round(delay, 2))
                await self._sleep(delay)
                if self._stopping:
                    return
                try:
                    await self._spawn(index)
                    backoff.started(self._clock())
                    break
                except Exception as exc:  # e.g. EMFILE: keep trying, the slot must not be given up
                    log.error("front restart failed", front=index, reason=str(exc) or type(exc).__name__)

    def hurry(self) -> None:
        """Second stop signal: fronts stop waiting for their in-flight calls."""
        for front in self.fronts.values():
            with contextlib.suppress(ProcessLookupError):
                front.process.send_signal(signal.SIGTERM)

    @property
    def tls(self) -> TlsMaterial | None:
        return self._tls

    def update_access(self, auth: AuthConfig, tokens: Sequence[Token], tls: TlsMaterial | None) -> None:
        """New tokens and certificate (SIGHUP): every front swaps its policy and, for its next TLS
        handshakes, its certificate; a front starting now gets them once it listens (`_spawn`)."""
        self._config.auth = auth
        self._tokens = list(tokens)
        self._tls = tls
        for front in self.fronts.values():
            front.link.send(self._auth_frame())

    def _access(self) -> FrontAccess:
        """What SIGHUP can change, as a front reads it at start (CONFIG) and on a reload (AUTH)."""
        return FrontAccess(
            self._config.auth.model_dump(mode="json"),
            tuple(export_tokens(self._tokens)),
            self._tls.export() if self._tls is not None else None,
        )

    def _auth_frame(self) -> tuple[Buffer, ...]:
        return frame(Kind.AUTH, payload=self._access().encode())

    def _send_level(self, level: str) -> None:
        """A front filters its own events, so it must follow the daemon's level."""
        for front in self.fronts.values():
            front.link.send(_level_frame(level))

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop accepting calls, let the fronts finish theirs (the daemon still answers them), then end."""
        self._stopping = True
        self._stop_listening()
        for task in self._supervisors:
            task.cancel()
        await asyncio.gather(*self._supervisors, return_exceptions=True)  # a restart in progress ends
        for front in self.fronts.values():
            with contextlib.suppress(ProcessLookupError):
                front.process.send_signal(signal.SIGTERM)
        await asyncio.gather(*(_end(f.process, drain_timeout_s + 5.0) for f in self.fronts.values()))
        for front in self.fronts.values():
            if front.link.transport is not None:
                front.link.transport.close()
        await self._relays.close(5.0)  # the fronts' last words (their stderr closes as they exit)


async def _abandon(
    link: FrontLink, parent: socket.socket, arena: Region | None, process: asyncio.subprocess.Process | None
) -> None:
    """Undo a front's start that failed: its arena, the daemon's end of the link, its process."""
    if arena is not None:
        arena.unlink()
        arena.drop_fd()
    if link.transport is not None:
        link.transport.close()
    else:
        parent.close()
    if process is not None:
        await _end(process, 0.0)


async def _end(process: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Wait for a process to exit; kill it after `timeout_s`."""
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
