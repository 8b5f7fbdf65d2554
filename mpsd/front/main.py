"""The front process: serve gRPC on the shared port (or one of its own), hand ModelInfer to the daemon,
forward the rest.

It holds no state of its own beyond the request keys it has declared to the daemon (`headers.py`).
ModelInfer travels to the daemon as the request's bytes, with where its pieces are, over the socketpair
the daemon gave it; every other RPC is relayed as raw messages, in its own call shape, to the daemon's gRPC
server on its private Unix socket. Access control runs here too, before a call goes anywhere.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import signal
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc
import structlog
from setproctitle import setproctitle

from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.security import AuthConfig
from mpsd.front.headers import DeclaredHeaders
from mpsd.ipc.front_arena import Allocator, Chunk, read_reply, write_request
from mpsd.ipc.front_protocol import FRONT_TITLE, FrontAccess, FrontConfig, FrontReady, MalformedMessage
from mpsd.ipc.front_wire import MAX_IN_FLIGHT, Buffer, FrameWriter, FrontLinkProtocol, Kind, frame, frame_of
from mpsd.ipc.heap import settle_collector
from mpsd.ipc.shm import Region
from mpsd.logs import LEVELS, configure, set_level
from mpsd.net import eventloop
from mpsd.net.auth import AccessPolicy, build_policy, import_tokens, refusal
from mpsd.net.certificates import Certificates, TlsMaterial
from mpsd.net.listen import Address, bind, connection_age_options, parse_address
from mpsd.net.methods import served_methods

log = structlog.get_logger("mpsd.front")

MODEL_INFER = "/inference.GRPCInferenceService/ModelInfer"
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
# Metadata gRPC itself sets on a call; everything else (authorization, application keys) is relayed.
_OWN_METADATA = ("user-agent", "content-type", "te", "grpc-", ":")


def relayed_metadata(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in metadata or () if not k.lower().startswith(_OWN_METADATA)]


class CoreLink:
    """The front's end of the socketpair: sends ModelInfer calls and resolves them with the daemon's reply.

    Large requests go through the arena the daemon created for this front (`mpsd/ipc/front_arena.py`) while
    it has room.
    """

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.settings: asyncio.Future[FrontConfig] = loop.create_future()
        self.lost: asyncio.Future[None] = loop.create_future()
        self.writer = FrameWriter()
        # Calls handed to the daemon and not yet answered. Past this many, calls wait here (holding their
        # gRPC stream, so flow control reaches the client) instead of piling up in the socket's buffer.
        self._window = asyncio.Semaphore(MAX_IN_FLIGHT)
        self._pending: dict[int, asyncio.Future[tuple[int, bytes | bytearray]]] = {}
        self._ids = itertools.count(1)
        self._arena: Region | None = None
        self._allocator: Allocator | None = None
        self.on_auth: Callable[[bytes | bytearray], None] = lambda _: None  # an AUTH payload
        self._chunks: dict[int, Chunk] = {}  # each call's chunk, until it is answered
        self.headers = DeclaredHeaders(self.send)

    def attach_arena(self, name: str, size: int) -> None:
        self._arena = Region.attach(name, size)
        self._allocator = Allocator(size)

    def protocol(self) -> FrontLinkProtocol:
        return FrontLinkProtocol(self._on_frame, self._on_lost)

    def send(self, parts: tuple[Buffer, ...]) -> None:
        self.writer.send(parts)

    def _on_frame(self, kind: int, call_id: int, number: float, payload: bytes | bytearray) -> None:
        if kind in (Kind.REPLY, Kind.REPLY_SHM):
            chunk = self._chunks.pop(call_id, None)
            if kind == Kind.REPLY_SHM:
                reply = None
                if chunk is not None and self._arena is not None:
                    reply = read_reply(self._arena, chunk, payload)
                if reply is None:  # cannot happen unless the two ends disagree
                    number, payload = _INTERNAL, b"the daemon answered outside the call's chunk"
                else:
                    payload = reply
            if chunk is not None and self._allocator is not None:
                self._allocator.free(chunk.start)
            waiter = self._pending.pop(call_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result((int(number), payload))
        elif kind == Kind.CONFIG and not self.settings.done():
            try:
                self.settings.set_result(FrontConfig.decode(payload))
            except MalformedMessage as exc:
                self.settings.set_exception(exc)
        elif kind == Kind.AUTH:
            self.on_auth(payload)
        elif kind == Kind.LOG_LEVEL:
            level = bytes(payload).decode()
            if level in LEVELS:
                set_level(level)

    def _on_lost(self, exc: Exception | None) -> None:
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_result((grpc.StatusCode.UNAVAILABLE.value[0], b"the daemon went away"))
        self._pending.clear()
        if not self.lost.done():
            self.lost.set_result(None)

    async def model_infer(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        if self.lost.done():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the daemon went away")
        async with self._window:
            call_id = next(self._ids)
            waiter = asyncio.get_running_loop().create_future()
            self._pending[call_id] = waiter
            remaining = context.time_remaining()  # measured now: time spent waiting above counts
            traceparent = _traceparent(context)
            if traceparent is not None:  # the daemon continues the caller's trace if it traces
                self.send(frame(Kind.TRACEPARENT, call_id, 0.0, traceparent))
            self.send(self._infer_frame(call_id, -1.0 if remaining is None else remaining, request))
            try:
                code, payload = await waiter
            except asyncio.CancelledError:
                if self._pending.pop(call_id, None) is not None:
                    self.send(frame(Kind.CANCEL, call_id))
                raise
        if code:
            await context.abort(_CODES.get(code, grpc.StatusCode.UNKNOWN), bytes(payload).decode())
        return payload if isinstance(payload, bytes) else bytes(payload)

    def _infer_frame(self, call_id: int, remaining: float, request: bytes) -> tuple[Buffer, ...]:
        """The request into the arena when it is large and there is room, else in the frame itself; split
        here (the spans first) unless it has no pieces to split."""
        spans = self.headers.spans(request)
        if self._allocator is not None and self._arena is not None:
            written = write_request(self._arena, self._allocator, request)
            if written is not None:
                self._chunks[call_id], ref = written
                if spans is None:
                    return frame(Kind.INFER_SHM, call_id, remaining, ref)
                return frame_of(Kind.INFER_SPLIT_SHM, call_id, remaining, (spans, ref))
        if spans is None:
            return frame(Kind.INFER, call_id, remaining, request)
        return frame_of(Kind.INFER_SPLIT, call_id, remaining, (spans, request))


def _traceparent(context: grpc.aio.ServicerContext) -> bytes | None:
    for key, value in context.invocation_metadata() or ():
        if key == "traceparent" and isinstance(value, str):
            return value.encode("ascii", "replace")[:256]
    return None


class Relay(grpc.GenericRpcHandler):  # type: ignore[misc]
    """ModelInfer to the daemon link; the daemon's other methods relayed, each in its own call shape, to
    the daemon's gRPC server. Methods the daemon does not have are UNIMPLEMENTED here already."""

    def __init__(self, link: CoreLink, channel: grpc.aio.Channel, policy: AccessPolicy) -> None:
        self._channel = channel
        self.policy = policy
        self._handlers: dict[str, grpc.RpcMethodHandler] = {}
        for method, (client_streaming, server_streaming) in served_methods().items():
            self._handlers[method] = self._handler(method, client_streaming, server_streaming)
        self._handlers[MODEL_INFER] = grpc.unary_unary_rpc_method_handler(link.model_infer)

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        """Access control happens here rather than in an interceptor: the same check, without the extra
        coroutine an asyncio interceptor costs every call."""
        method: str = handler_call_details.method
        error = self.policy.check(method, handler_call_details.invocation_metadata)
        if error is not None:
            log.info("call refused", method=method, code=error.code.value, reason=error.message)
            return refusal(error)
        return self._handlers.get(method)

    def _handler(self, method: str, client_streaming: bool, server_streaming: bool) -> grpc.RpcMethodHandler:
        channel = self._channel

        def options(context: grpc.aio.ServicerContext) -> dict[str, Any]:
            return {
                "metadata": relayed_metadata(context.invocation_metadata()),
                "timeout": context.time_remaining(),
            }

        async def unary_unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            try:
                response: bytes = await channel.unary_unary(method)(request, **options(context))
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            return response

        async def unary_stream(request: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
            call = channel.unary_stream(method)(request, **options(context))
            try:
                while (response := await call.read()) is not grpc.aio.EOF:
                    yield response
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            finally:
                call.cancel()

        async def stream_stream(
            requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[bytes]:
            call = channel.stream_stream(method)(**options(context))

            async def pump() -> None:
                async for request in requests:
                    await call.write(request)
                await call.done_writing()

            pumping = asyncio.ensure_future(pump())
            try:
                while (response := await call.read()) is not grpc.aio.EOF:
                    yield response
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            finally:
                pumping.cancel()
                call.cancel()

        async def stream_unary(requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
            try:
                response: bytes = await channel.stream_unary(method)(requests, **options(context))
            except grpc.aio.AioRpcError as exc:
                await context.abort(exc.code(), exc.details() or "")
            return response

        if client_streaming and server_streaming:
            return grpc.stream_stream_rpc_method_handler(stream_stream)
        if client_streaming:
            return grpc.stream_unary_rpc_method_handler(stream_unary)
        if server_streaming:
            return grpc.unary_stream_rpc_method_handler(unary_stream)
        return grpc.unary_unary_rpc_method_handler(unary_unary)


async def serve(sock: socket.socket) -> int:
    """Serve what the daemon's CONFIG says until SIGTERM or the daemon goes away; the exit code."""
    loop = asyncio.get_running_loop()
    link = CoreLink()
    transport, _ = await loop.create_unix_connection(link.protocol, sock=sock)
    link.writer.transport = transport
    first: list[asyncio.Future[Any]] = [link.settings, link.lost]
    await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
    if not link.settings.done():
        return 1  # the daemon went away before it said what to serve
    try:
        settings = link.settings.result()
    except MalformedMessage as exc:
        return await _failed(link, exc)
    config = DaemonConfig.model_validate(settings.config)
    _take_role(settings)
    address = parse_address(settings.address)
    limit = config.max_message_bytes
    sizes = [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
    channel = grpc.aio.insecure_channel(settings.daemon_target, options=sizes)
    try:
        server = await _start_server(link, settings, config, address, channel, sizes)
    except Exception as exc:
        return await _failed(link, exc)
    ready = FrontReady(os.getpid(), eventloop.loop_name(), eventloop.busy_poll_us(), settle_collector())
    link.send(frame(Kind.READY, payload=ready.encode()))
    await _serve_until_stopped(server, channel, link, config)
    return 0


def _take_role(settings: FrontConfig) -> None:
    """Log as front N at the daemon's level, and be named as front N in ps."""
    # JSON lines on stderr, whatever the daemon's format: the daemon reads them and logs them as its own.
    configure(settings.log_level, "json")
    structlog.contextvars.bind_contextvars(front=settings.index)
    setproctitle(f"{FRONT_TITLE}{settings.index}")  # named in ps by role


async def _start_server(
    link: CoreLink,
    settings: FrontConfig,
    config: DaemonConfig,
    address: Address,
    channel: grpc.aio.Channel,
    sizes: list[tuple[str, int]],
) -> grpc.aio.Server:
    """The gRPC server, listening, with the access policy and certificates the daemon sent."""
    if settings.arena is not None:
        link.attach_arena(settings.arena.name, settings.arena.size)
    mutual_tls = config.tls is not None and config.tls.client_ca_file is not None

    def access_policy(access: FrontAccess) -> tuple[AccessPolicy, int]:
        """The policy for the auth settings and tokens the daemon sent (CONFIG or AUTH); their count."""
        tokens = import_tokens(access.tokens)
        auth = AuthConfig.model_validate(access.auth)
        return build_policy(auth, address.is_local, mutual_tls, address.text, tokens=tokens), len(tokens)

    age = connection_age_options(config.max_connection_age_s, config.max_connection_age_grace_s)
    # A port of its own is not shared: without SO_REUSEPORT a second server there fails to bind.
    reuse = ("grpc.so_reuseport", int(settings.share_port))
    server = grpc.aio.server(options=[*sizes, reuse, *age])
    relay = Relay(link, channel, access_policy(settings.access)[0])
    server.add_generic_rpc_handlers([relay])
    tls = settings.access.tls
    certificates = Certificates(TlsMaterial.load(tls)) if tls is not None else None
    link.on_auth = _auth_reloader(relay, certificates, access_policy)
    bind(server, address, certificates)
    await server.start()
    return server


def _auth_reloader(
    relay: Relay,
    certificates: Certificates | None,
    access_policy: Callable[[FrontAccess], tuple[AccessPolicy, int]],
) -> Callable[[bytes | bytearray], None]:
    """The link's AUTH handler: it swaps in the relay's policy and the certificates; on a frame it cannot
    read, the previous ones stay."""

    def on_auth(payload: bytes | bytearray) -> None:
        """New tokens and certificate from the daemon (SIGHUP), as it read them."""
        try:
            access = FrontAccess.decode(payload)
            policy, tokens = access_policy(access)
            if certificates is not None and access.tls is not None:
                certificates.replace(TlsMaterial.load(access.tls))
        except Exception as exc:  # a frame the two ends disagree on: keep serving with the old ones
            log.error("access settings not reloaded; the previous ones stay in force", reason=str(exc))
            return
        relay.policy = policy
        log.info("tokens reloaded", tokens=tokens)
        if certificates is not None:
            log.info("certificates reloaded", client_certificates=certificates.material.mutual)

    return on_auth


async def _serve_until_stopped(
    server: grpc.aio.Server, channel: grpc.aio.Channel, link: CoreLink, config: DaemonConfig
) -> None:
    """Serve until the daemon goes away (stop at once) or SIGTERM (drain for drain_timeout_s; a second
    SIGTERM cuts the drain short). SIGINT is ignored: the daemon decides, and a terminal's ^C reaches it."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    hurry = asyncio.Event()

    def on_term() -> None:
        (hurry if stop.is_set() else stop).set()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the daemon decides; a terminal ^C reaches it too
    waiters: list[asyncio.Future[Any]] = [asyncio.ensure_future(stop.wait()), link.lost]
    await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    if link.lost.done():
        log.warning("daemon went away; front stopping")
        await server.stop(0)
        return
    stopping = asyncio.ensure_future(server.stop(config.drain_timeout_s))
    quick = asyncio.ensure_future(hurry.wait())
    await asyncio.wait({stopping, quick}, return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():
        await server.stop(0)
    await channel.close()


async def _failed(link: CoreLink, exc: Exception) -> int:
    """Tell the daemon why this front cannot serve; the exit code."""
    link.send(frame(Kind.FAILED, payload=f"{type(exc).__name__}: {exc}".encode()))
    await asyncio.sleep(0.1)  # let the frame leave before the process ends
    return 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpsd.front")
    parser.add_argument("--fd", type=int, required=True, help="the socketpair end the daemon passed")
    parser.add_argument("--event-loop", choices=["asyncio", "uvloop"], default="asyncio")
    parser.add_argument("--busy-poll-us", type=int, default=0, help="the daemon's busy_poll_us")
    args = parser.parse_args(argv)
    sock = socket.socket(fileno=args.fd)
    return eventloop.run(serve(sock), args.event_loop, args.busy_poll_us)
