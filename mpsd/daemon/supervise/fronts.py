"""Front processes: more cores for gRPC, one place where requests meet.

One Python process spends most of a small request's CPU time in gRPC itself (HTTP/2, the asyncio
machinery), so one front caps a daemon at a few thousand requests per second. With `front_processes: N`
the daemon starts N front processes that share the TCP port through SO_REUSEPORT (the kernel spreads
connections over them) and keeps the rest here: the registry, the batcher and the workers.

A front hands ModelInfer calls to the core as serialized bytes over a socketpair (`front/wire.py`), large
ones through a shared-memory arena the core creates for it (`front/arena.py`); the
core decodes, validates, batches and answers with serialized bytes, so gRPC runs in the fronts and
mpsd's own work here. Every other RPC the front forwards unchanged to the core's gRPC server on a
private Unix socket, so the core stays the one place that holds state.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import structlog

from mpsd import logs
from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.security import AuthConfig, Token
from mpsd.daemon.supervise.child_output import output_lines
from mpsd.daemon.supervise.launch import worker_base_env
from mpsd.errors import ConfigError, MpsdError
from mpsd.ipc.front_arena import ARENA_BYTES, ARENA_MIN, INFER_REF, REPLY_REF

# A front holds its calls to MAX_IN_FLIGHT; should one ever send more, the core stops reading its socket.
from mpsd.ipc.front_wire import (
    MAX_IN_FLIGHT,
    SOCKET_BUFFER,
    Buffer,
    FrameProtocol,
    FrameWriter,
    Kind,
    frame,
    frame_of,
    nbytes,
    widen_buffers,
)
from mpsd.ipc.shm import Region
from mpsd.net.auth import export_tokens
from mpsd.net.certificates import TlsMaterial
from mpsd.net.listen import Address, parse_address
from mpsd.net.status import grpc_status

log = structlog.get_logger("mpsd.daemon.supervise.fronts")
FRONT_MODULE = "mpsd.front"  # what a front process runs: `python -m FRONT_MODULE`


def is_front_command(argv: Sequence[str]) -> bool:
    """Whether a process's command line is a front process's (tools tell fronts from model workers)."""
    return FRONT_MODULE in argv


# ModelInfer on request bytes; the response comes back as pieces to be sent back to back.
InferBytes = Callable[[bytes | bytearray | memoryview, float | None], Awaitable[Sequence[Buffer]]]

START_TIMEOUT_S = 30.0
RESTART_DELAY_S = 1.0
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]


def front_count(config: DaemonConfig, cpu_count: int | None = None, platform: str = sys.platform) -> int:
    """How many front processes to run; ConfigError when the setting cannot work with the address."""
    wanted = config.front_processes
    address = parse_address(config.grpc_address)
    if wanted == "auto":
        cpus = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
        if not platform.startswith("linux") or address.unix_path is not None or cpus <= 4:
            return 0
        return min(4, cpus // 4)
    if wanted == 0:
        return 0
    where = f"front_processes: {wanted}"
    if not platform.startswith("linux"):
        raise ConfigError(
            f"{where}: front processes share the port through SO_REUSEPORT, which spreads connections "
            "only on Linux; use 0 (the daemon serves gRPC itself)"
        )
    if address.unix_path is not None:
        raise ConfigError(f"{where}: a Unix socket cannot be shared by several processes; use a TCP address")
    if address.port == 0:
        raise ConfigError(f"{where}: front processes need a fixed port, not 0")
    return wanted


def check_port_free(address: Address) -> None:
    """Fail now, with a clear message, if another server holds the port: with SO_REUSEPORT on, another
    mpsd of the same user could otherwise join the port and share its connections unnoticed."""
    try:
        infos = socket.getaddrinfo(
            address.host, address.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise ConfigError(f"grpc_address {address.text!r}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as probe:
            # As the servers themselves do: connections of a previous run in TIME_WAIT do not count.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise OSError(f"cannot listen on {address.text}: the port is in use") from None
                if exc.errno != errno.EADDRNOTAVAIL:  # e.g. no IPv6 on this host: the front skips it too
                    raise


CORE_DIR_PREFIX = "mpsd-core-"


def _socket_base() -> Path:
    """Where the daemon's private socket directory goes: short enough for a socket path."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) if len(base) <= 60 and os.path.isdir(base) else Path("/tmp")


def make_core_dir() -> Path:
    """A private (0700) directory for the daemon's internal gRPC socket, named after this process."""
    return Path(tempfile.mkdtemp(prefix=f"{CORE_DIR_PREFIX}{os.getpid()}-", dir=_socket_base()))


def remove_stale_core_dirs() -> list[str]:
    """Remove socket directories of daemons that died without cleaning up (kill -9)."""
    removed = []
    for entry in _socket_base().glob(f"{CORE_DIR_PREFIX}*-*"):
        pid = entry.name[len(CORE_DIR_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or not entry.is_dir():
            continue
        if entry.stat().st_uid != os.getuid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # still running
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        shutil.rmtree(entry, ignore_errors=True)
        removed.append(entry.name)
    return removed


class FrontFailed(Exception):
    """A front process could not start (its reason, or how it exited)."""


def _arena_ref(payload: bytes | bytearray) -> tuple[int, int, int]:
    """(start, length, capacity) of an INFER_SHM frame; a malformed one reads as out of bounds."""
    if len(payload) != INFER_REF.size:
        return 0, 1, 0
    start, length, capacity = INFER_REF.unpack(payload)
    return int(start), int(length), int(capacity)


def _level_frame(level: str) -> tuple[Buffer, ...]:
    return frame(Kind.LOG_LEVEL, payload=level.encode())


@dataclass
class FrontCounts:
    """What one front slot has handed to the core, over its processes' restarts."""

    served: int = 0  # ModelInfer calls answered
    arena_requests: int = 0  # of which the request came through the arena
    arena_replies: int = 0  # and the reply went back through it


@dataclass
class FrontLink:
    """The core's end of one front's socketpair: runs the ModelInfer calls the front hands over."""

    index: int
    infer: InferBytes
    on_lost: Callable[[FrontLink], None]
    transport: asyncio.Transport | None = None
    ready: asyncio.Future[dict[str, object]] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    calls: dict[int, asyncio.Task[None]] = field(default_factory=dict)
    counts: FrontCounts = field(default_factory=FrontCounts)
    writer: FrameWriter = field(default_factory=FrameWriter)
    arena: Region | None = None  # requests' views keep it mapped after the front is gone
    _paused: bool = False

    def protocol(self) -> FrameProtocol:
        return FrameProtocol(self._on_frame, self._lost)

    def attach(self, transport: asyncio.Transport) -> None:
        self.transport = self.writer.transport = transport

    def send(self, parts: tuple[Buffer, ...]) -> None:
        self.writer.send(parts)

    def _on_frame(self, kind: int, call_id: int, number: float, payload: bytes | bytearray) -> None:
        if kind in (Kind.INFER, Kind.INFER_SHM):
            deadline = time.monotonic() + number if number >= 0 else None
            chunk: tuple[int, int] | None = None
            request: bytes | bytearray | memoryview = payload
            if kind == Kind.INFER_SHM:
                start, length, capacity = _arena_ref(payload)
                if self.arena is None or length > capacity or start + capacity > self.arena.size:
                    reason = f"arena reference out of bounds: {start}+{length} (chunk {capacity})"
                    self.send(frame(Kind.REPLY, call_id, _INTERNAL, reason.encode()))
                    return
                chunk, request = (start, capacity), self.arena.buf[start : start + length]
            self.calls[call_id] = asyncio.get_running_loop().create_task(
                self._serve(call_id, request, deadline, chunk)
            )
            if len(self.calls) >= MAX_IN_FLIGHT and not self._paused and self.transport is not None:
                self._paused = True
                self.transport.pause_reading()
        elif kind == Kind.CANCEL:
            # Cancelling the task cancels the request's future at once: a batch formed before then copies
            # nothing from it (`worker_process.assemble`), so the answer below may free its arena chunk.
            task = self.calls.pop(call_id, None)
            if task is not None:
                task.cancel()
        elif kind == Kind.READY and not self.ready.done():
            self.ready.set_result(json.loads(payload))
        elif kind == Kind.FAILED and not self.ready.done():
            self.ready.set_exception(FrontFailed(bytes(payload).decode("utf-8", "replace")))
        else:
            log.warning("unexpected frame from a front", front=self.index, kind=kind)

    async def _serve(
        self,
        call_id: int,
        payload: bytes | bytearray | memoryview,
        deadline: float | None,
        chunk: tuple[int, int] | None,
    ) -> None:
        """Run one call and answer it, a cancelled one too (the front expects an answer to every call)."""
        cancelled = False
        try:
            reply = self._reply(call_id, await self.infer(payload, deadline), chunk)
        except asyncio.CancelledError:
            reply = frame(Kind.REPLY, call_id, _CANCELLED, b"cancelled")
            cancelled = True
        except MpsdError as exc:
            reply = frame(Kind.REPLY, call_id, grpc_status(exc).value[0], exc.message.encode())
        except Exception as exc:
            log.exception("unexpected error in a forwarded request", front=self.index)
            reply = frame(Kind.REPLY, call_id, _INTERNAL, f"{type(exc).__name__}: {exc}".encode())
        finally:
            self.calls.pop(call_id, None)
            if self._paused and len(self.calls) < MAX_IN_FLIGHT // 2 and self.transport is not None:
                self._paused = False
                self.transport.resume_reading()
        if not cancelled:
            self.counts.served += 1
            self.counts.arena_requests += chunk is not None
        self.send(reply)

    def _reply(
        self, call_id: int, parts: Sequence[Buffer], chunk: tuple[int, int] | None
    ) -> tuple[Buffer, ...]:
        """A large response goes into the call's chunk when it fits, the rest in the frame."""
        if chunk is None or self.arena is None:
            return frame_of(Kind.REPLY, call_id, 0, parts)
        total = sum(nbytes(p) for p in parts)
        if total < ARENA_MIN or total > chunk[1]:
            return frame_of(Kind.REPLY, call_id, 0, parts)
        buf, pos = self.arena.buf, chunk[0]
        for piece in parts:
            view = memoryview(piece).cast("B")
            buf[pos : pos + view.nbytes] = view
            pos += view.nbytes
        self.counts.arena_replies += 1
        return frame(Kind.REPLY_SHM, call_id, 0, REPLY_REF.pack(total))

    def _lost(self, exc: Exception | None) -> None:
        for task in list(self.calls.values()):
            task.cancel()
        self.calls.clear()
        self.arena = None  # unmapped once the last request's views of it are gone
        if not self.ready.done():  # (a cancelled wait counts as done)
            self.ready.set_exception(FrontFailed("it closed its connection before it was listening"))
        self.on_lost(self)


@dataclass(frozen=True)
class FrontInfo:
    index: int
    pid: int
    state: str  # "listening", or "restarting" between a death and the new process listening
    requests: int  # ModelInfer calls handed to the core, over restarts
    restarts: int


@dataclass
class Front:
    index: int
    process: asyncio.subprocess.Process
    link: FrontLink


class FrontPool:
    """Starts, supervises and stops the front processes."""

    def __init__(
        self,
        count: int,
        config: DaemonConfig,
        core_target: str,
        infer: InferBytes,
        tokens: Sequence[Token] = (),
        tls: TlsMaterial | None = None,
    ) -> None:
        self.count = count
        self._config = config
        # As the daemon read them: fronts never read token or certificate files.
        self._tokens = list(tokens)
        self._tls = tls
        self._core_target = core_target
        self._infer = infer
        self.fronts: dict[int, Front] = {}
        self.restarts: dict[int, int] = {}
        self.counts: dict[int, FrontCounts] = {}
        self._stopping = False
        self._supervisors: list[asyncio.Task[None]] = []
        self._relays: set[asyncio.Task[None]] = set()
        self._stop_listening: Callable[[], None] = lambda: None
        self._told_buffer_cap = False
        self._told_no_arena = False

    def served(self) -> dict[int, int]:
        """ModelInfer calls each front slot has handed to the core, over restarts."""
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
            )
            for i, f in sorted(self.fronts.items())
        ]

    async def start(self) -> None:
        """Start every front and wait until all listen; FrontFailed (the others stopped) if one cannot."""
        self._stop_listening = logs.on_level_change(self._send_level)
        started = await asyncio.gather(*(self._spawn(i) for i in range(self.count)), return_exceptions=True)
        errors = [r for r in started if isinstance(r, BaseException)]
        if errors:
            await self.stop(0.0)
            raise errors[0]
        self._supervisors = [asyncio.create_task(self._supervise(i)) for i in range(self.count)]

    async def _spawn(self, index: int) -> Front:
        """Start one front and wait until it listens. On any failure, or if cancelled (the daemon
        stopping meanwhile), the process is ended and the socket closed: nothing half-started stays."""
        loop = asyncio.get_running_loop()
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
        process: asyncio.subprocess.Process | None = None
        counts = self.counts.setdefault(index, FrontCounts())
        link = FrontLink(index, self._infer, self._on_link_lost, counts=counts)
        arena = link.arena = self._arena()
        try:
            try:
                process = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    FRONT_MODULE,
                    "--fd",
                    str(child.fileno()),
                    "--event-loop",
                    self._config.event_loop,
                    pass_fds=(child.fileno(),),
                    stdin=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.PIPE,
                    limit=LOG_LINE_LIMIT,
                    env=worker_base_env(),
                )
            finally:
                child.close()
            assert process.stderr is not None
            relay = asyncio.create_task(relay_front_log(process.stderr, index, process.pid))
            self._relays.add(relay)  # a strong reference until the front's stderr closes
            relay.add_done_callback(self._relays.discard)
            transport, _ = await loop.create_unix_connection(link.protocol, sock=parent)
            link.attach(transport)
            sent_auth, sent_tokens, sent_tls = self._config.auth, self._tokens, self._tls
            sent_level = logs.level_name()
            settings = {
                "index": index,
                "log_level": sent_level,  # now: LogSettings or SIGHUP may have changed it
                "core_target": self._core_target,
                "config": self._config.model_dump(mode="json"),
                "arena": {"name": arena.name, "size": arena.size} if arena is not None else None,
                **self._access(),
            }
            link.send(frame(Kind.CONFIG, payload=json.dumps(settings).encode()))
            await asyncio.wait_for(link.ready, START_TIMEOUT_S)
            # A SIGHUP or LogSettings while it started reached only the fronts already listening.
            changed = (self._config.auth, self._tokens, self._tls) != (sent_auth, sent_tokens, sent_tls)
            if changed:
                link.send(self._auth_frame())
            if logs.level_name() != sent_level:
                link.send(_level_frame(logs.level_name()))
        except BaseException as exc:
            if arena is not None:
                arena.unlink()
            if link.transport is not None:
                link.transport.close()
            else:
                parent.close()
            if process is not None:
                await _end(process, 0.0)
            if isinstance(exc, (FrontFailed, TimeoutError)):
                reason = str(exc) or f"it did not listen within {START_TIMEOUT_S:g} s"
                raise FrontFailed(f"front process {index} could not start: {reason}") from None
            raise
        if arena is not None:
            arena.unlink()  # both ends have it mapped: the memory goes when both unmap it, however they end
        front = Front(index, process, link)
        self.fronts[index] = front
        log.info(
            "front listening",
            front=index,
            pid=process.pid,
            address=self._config.grpc_address,
            event_loop=link.ready.result().get("event_loop"),
        )
        return front

    def _arena(self) -> Region | None:
        """A front's arena, or None (large calls then take the socket) where /dev/shm has no room."""
        try:
            return Region.create(ARENA_BYTES, reserve=True)
        except OSError as exc:
            if not self._told_no_arena:
                self._told_no_arena = True
                log.warning(
                    "no shared memory for the front arenas: large calls go through the fronts' sockets",
                    asked=ARENA_BYTES,
                    reason=exc.strerror or str(exc),
                    hint="give /dev/shm more room (containers: --shm-size)",
                )
            return None

    def _on_link_lost(self, link: FrontLink) -> None:
        ready = link.ready
        if not self._stopping and ready.done() and not ready.cancelled() and not ready.exception():
            log.warning("front process connection lost", front=link.index)

    async def _supervise(self, index: int) -> None:
        """Restart a front that died; its clients reconnect and the kernel sends them to the live ones."""
        while not self._stopping:
            front = self.fronts[index]
            code = await front.process.wait()
            if self._stopping:
                return
            log.error("front process exited; restarting it", front=index, pid=front.process.pid, code=code)
            if front.link.transport is not None:
                front.link.transport.close()
            self.restarts[index] = self.restarts.get(index, 0) + 1
            while not self._stopping:
                await asyncio.sleep(RESTART_DELAY_S)
                try:
                    await self._spawn(index)
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

    def _access(self) -> dict[str, Any]:
        """What SIGHUP can change, as a front reads it at start (CONFIG) and on a reload (AUTH)."""
        return {
            "auth": self._config.auth.model_dump(mode="json"),
            "tokens": export_tokens(self._tokens),
            "tls": self._tls.export() if self._tls is not None else None,
        }

    def _auth_frame(self) -> tuple[Buffer, ...]:
        return frame(Kind.AUTH, payload=json.dumps(self._access()).encode())

    def _send_level(self, level: str) -> None:
        """A front filters its own events, so it must follow the daemon's level."""
        for front in self.fronts.values():
            front.link.send(_level_frame(level))

    async def stop(self, drain_timeout_s: float) -> None:
        """Stop accepting calls, let the fronts finish theirs (the core still answers them), then end."""
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
        if self._relays:  # the fronts' last words (their stderr closes as they exit)
            await asyncio.wait(set(self._relays), timeout=5.0)


async def relay_front_log(stream: asyncio.StreamReader, index: int, pid: int) -> None:
    """A front's log events become the daemon's own: rendered in the daemon's format, filtered at its level
    (which the front follows, so it writes only what passes), and in the event stream `mpsd logs` reads.
    The front writes them as JSON lines; any other line on its stderr (a traceback from a crash) is relayed
    as text."""

    def too_long() -> None:
        log.warning("front log line too long; dropped", front=index, pid=pid, limit=LOG_LINE_LIMIT)

    async for text in output_lines(stream, too_long):
        if not text:
            continue
        try:
            fields = json.loads(text)
        except ValueError:
            fields = None
        if not isinstance(fields, dict) or not isinstance(fields.get("event"), str):
            log.warning(text, source="front.stderr", front=index, pid=pid, event_kind="stderr")
            continue
        message = fields.pop("event")
        level = str(fields.pop("level", "info"))
        fields.pop("timestamp", None)
        fields.setdefault("front", index)
        emit = getattr(log, level if level in FRONT_LOG_LEVELS else "info")
        emit(message, **{**fields, "source": "front", "pid": pid})


LOG_LINE_LIMIT = 1 << 20  # a front's log line (a JSON event, a traceback on one line) up to 1 MiB
FRONT_LOG_LEVELS = frozenset(logs.SEVERITIES)


async def _end(process: asyncio.subprocess.Process, timeout_s: float) -> None:
    """Wait for a process to exit; kill it after `timeout_s`."""
    try:
        await asyncio.wait_for(process.wait(), timeout_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        await process.wait()
