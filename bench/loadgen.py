"""Closed-loop load generator: a few client processes, each with its own gRPC channel, sending requests
that were serialized once, ahead of time.

The client processes import `grpc` and nothing else (no protobuf modules, no tritonclient): a method called
with no serializers sends the prepared bytes as they are and hands back the response's bytes undecoded, so
the per-request client cost is the gRPC call itself. For HTTP the prepared bytes are the whole HTTP/1.1
request, written on a keep-alive connection (one per request in flight, HTTP/1.1 having no multiplexing),
and the client reads the status line, the headers and Content-Length bytes of body: no HTTP library either.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from bench.cpus import pinned_to

INFER_METHOD = "/inference.GRPCInferenceService/ModelInfer"
CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 256 * 1024 * 1024),
    ("grpc.max_send_message_length", 256 * 1024 * 1024),
]


@dataclass(frozen=True)
class LoadSpec:
    """One measurement: `concurrency` requests in flight per client process, for `duration_s` seconds
    after `warmup_s` seconds whose requests are not counted."""

    address: str
    request: bytes
    concurrency: int
    duration_s: float
    warmup_s: float
    method: str = INFER_METHOD
    protocol: str = "grpc"  # or "http": `request` is then a whole HTTP/1.1 request, `address` host:port
    # channel options beyond the message sizes (a service config for client-side balancing, for instance)
    options: tuple[tuple[str, Any], ...] = ()
    # several prepared requests (gRPC, several in flight): each in-flight loop sends them in turn from an
    # offset of its own, instead of `request` alone (requests of mixed shapes, bench/buckets_gpu.py)
    requests: tuple[bytes, ...] = ()
    # gRPC connections per client process, the in-flight requests spread over them in turn: many clients
    # each on a connection of its own, as against one process multiplexing them all on one
    connections: int = 1


@dataclass
class LoadResult:
    """Merged over all client processes: latencies (ns) of requests that finished inside the window."""

    latencies_ns: list[int] = field(default_factory=list)
    window_s: float = 0.0
    errors: int = 0
    first_error: str = ""
    last_response: bytes = b""
    completed: int = 0  # every answered request, warm-up included (for CPU time per request)

    @property
    def throughput(self) -> float:
        return len(self.latencies_ns) / self.window_s if self.window_s else 0.0


Outcome = tuple[list[int], int, str, bytes, int]  # latencies, errors, first error, a response, completed


def _run_sync(channel: Any, spec: LoadSpec, start_at: float) -> Outcome:
    """One request in flight: a blocking call per request, the lowest-latency client grpc has."""
    import grpc

    call = channel.unary_unary(spec.method)
    lat: list[int] = []
    errors = 0
    completed = 0
    first_error = ""
    response = b""
    while time.time() < start_at:
        time.sleep(0.001)
    t_begin = time.perf_counter_ns()
    count_from = t_begin + int(spec.warmup_s * 1e9)
    stop_at = count_from + int(spec.duration_s * 1e9)
    request = spec.request
    while True:
        t0 = time.perf_counter_ns()
        if t0 >= stop_at:
            break
        try:
            response = call(request)
        except grpc.RpcError as exc:
            errors += 1
            first_error = first_error or f"{exc.code()}: {exc.details()}"
            continue
        t1 = time.perf_counter_ns()
        completed += 1
        if t0 >= count_from and t1 <= stop_at:
            lat.append(t1 - t0)
    return lat, errors, first_error, response, completed


def _run_async(target: str, spec: LoadSpec, start_at: float) -> Outcome:
    """Several requests in flight on one channel, one asyncio task per in-flight request."""
    import grpc

    lat: list[int] = []
    state: dict[str, Any] = {"errors": 0, "first_error": "", "response": b"", "completed": 0}

    async def main() -> None:
        # Channels of one process share their connection unless each keeps its subchannels to itself.
        own = [("grpc.use_local_subchannel_pool", 1)] if spec.connections > 1 else []
        options = [*CHANNEL_OPTIONS, *spec.options, *own]
        async with contextlib.AsyncExitStack() as stack:
            channels = [
                await stack.enter_async_context(grpc.aio.insecure_channel(target, options=options))
                for _ in range(max(spec.connections, 1))
            ]
            calls = [channel.unary_unary(spec.method) for channel in channels]
            for call in calls:
                await call(spec.request)  # connect before the clock starts
            while time.time() < start_at:
                await asyncio.sleep(0.001)
            t_begin = time.perf_counter_ns()
            count_from = t_begin + int(spec.warmup_s * 1e9)
            stop_at = count_from + int(spec.duration_s * 1e9)

            async def loop(offset: int, call: Any) -> None:
                pool = spec.requests or (spec.request,)
                sent = offset
                while True:
                    t0 = time.perf_counter_ns()
                    if t0 >= stop_at:
                        return
                    request = pool[sent % len(pool)]
                    sent += 1
                    try:
                        state["response"] = await call(request)
                    except grpc.RpcError as exc:
                        state["errors"] += 1
                        state["first_error"] = state["first_error"] or f"{exc.code()}: {exc.details()}"
                        continue
                    t1 = time.perf_counter_ns()
                    state["completed"] += 1
                    if t0 >= count_from and t1 <= stop_at:
                        lat.append(t1 - t0)

            offsets = range(os.getpid() * 7919, os.getpid() * 7919 + spec.concurrency * 97, 97)
            await asyncio.gather(*(loop(offset, calls[i % len(calls)]) for i, offset in enumerate(offsets)))

    asyncio.run(main())
    return lat, state["errors"], state["first_error"], state["response"], state["completed"]


class HttpError(Exception):
    pass


def _http_head(head: bytes) -> tuple[bool, int]:
    """(status 200, body length) of a response whose status line and headers are `head`."""
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    return head[9:12] == b"200", length


def _http_checked(ok: bool, body: bytes) -> bytes:
    if not ok:
        raise HttpError(body[:300].decode("utf-8", "replace"))
    return body


def _http_call(sock: socket.socket, request: bytes, pending: bytearray) -> bytes:
    """One request on a blocking keep-alive socket; `pending` holds bytes read past the last response."""
    sock.sendall(request)
    while (end := pending.find(b"\r\n\r\n")) < 0:
        chunk = sock.recv(262144)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        pending += chunk
    ok, length = _http_head(bytes(pending[:end]))
    start = end + 4
    while len(pending) - start < length:
        chunk = sock.recv(262144)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        pending += chunk
    body = bytes(pending[start : start + length])
    del pending[: start + length]
    return _http_checked(ok, body)


def _run_http_sync(spec: LoadSpec, start_at: float) -> Outcome:
    host, _, port = spec.address.rpartition(":")
    lat: list[int] = []
    errors = completed = 0
    first_error = ""
    response = b""
    with socket.create_connection((host, int(port))) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pending = bytearray()
        while time.time() < start_at:
            time.sleep(0.001)
        count_from = time.perf_counter_ns() + int(spec.warmup_s * 1e9)
        stop_at = count_from + int(spec.duration_s * 1e9)
        while True:
            t0 = time.perf_counter_ns()
            if t0 >= stop_at:
                break
            try:
                response = _http_call(sock, spec.request, pending)
            except HttpError as exc:
                errors += 1
                first_error = first_error or str(exc)
                continue
            t1 = time.perf_counter_ns()
            completed += 1
            if t0 >= count_from and t1 <= stop_at:
                lat.append(t1 - t0)
    return lat, errors, first_error, response, completed


def _run_http_async(spec: LoadSpec, start_at: float) -> Outcome:
    """`concurrency` keep-alive connections, each with one request in flight."""
    host, _, port = spec.address.rpartition(":")
    lat: list[int] = []
    state: dict[str, Any] = {"errors": 0, "first_error": "", "response": b"", "completed": 0}

    async def one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
        writer.write(spec.request)
        ok, length = _http_head((await reader.readuntil(b"\r\n\r\n"))[:-4])
        return _http_checked(ok, await reader.readexactly(length))

    async def main() -> None:
        streams = [await asyncio.open_connection(host, int(port)) for _ in range(spec.concurrency)]
        for _, writer in streams:
            writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while time.time() < start_at:
            await asyncio.sleep(0.001)
        count_from = time.perf_counter_ns() + int(spec.warmup_s * 1e9)
        stop_at = count_from + int(spec.duration_s * 1e9)

        async def loop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                t0 = time.perf_counter_ns()
                if t0 >= stop_at:
                    return
                try:
                    state["response"] = await one(reader, writer)
                except HttpError as exc:
                    state["errors"] += 1
                    state["first_error"] = state["first_error"] or str(exc)
                    continue
                t1 = time.perf_counter_ns()
                state["completed"] += 1
                if t0 >= count_from and t1 <= stop_at:
                    lat.append(t1 - t0)

        try:
            await asyncio.gather(*(loop(r, w) for r, w in streams))
        finally:
            for _, writer in streams:
                writer.close()

    asyncio.run(main())
    return lat, state["errors"], state["first_error"], state["response"], state["completed"]


def _client_main(conn: Connection) -> None:
    """A client process: waits for (spec, start time) on its pipe, runs, sends back what it measured."""
    import grpc

    channels: dict[str, Any] = {}
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent went away
            break
        if msg is None:
            break
        spec, start_at = msg
        try:
            if spec.protocol == "http":
                run = _run_http_sync if spec.concurrency == 1 else _run_http_async
                conn.send(("ok", run(spec, start_at)))
            elif spec.concurrency == 1:
                key = f"{spec.address} {spec.options}"
                channel = channels.get(key)
                if channel is None:
                    channel = grpc.insecure_channel(spec.address, options=[*CHANNEL_OPTIONS, *spec.options])
                    grpc.channel_ready_future(channel).result(timeout=30)
                    channels[key] = channel
                conn.send(("ok", _run_sync(channel, spec, start_at)))
            else:
                conn.send(("ok", _run_async(spec.address, spec, start_at)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    for channel in channels.values():
        channel.close()


class ClientPool:
    """`processes` client processes, started once as fresh interpreters (`python -m bench.loadgen`) that
    import only grpc: no torch, no inherited threads."""

    def __init__(self, processes: int, cpus: Collection[int] | None = None) -> None:
        """With `cpus`, the client processes run on those CPUs only."""
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for _ in range(processes):
            parent, child = socket.socketpair()
            proc = subprocess.Popen(
                [sys.executable, "-m", "bench.loadgen", "--fd", str(child.fileno())],
                pass_fds=(child.fileno(),),
                cwd=root,
                stdin=subprocess.DEVNULL,
                preexec_fn=pinned_to(cpus),
            )
            child.close()
            self._conns.append(Connection(parent.detach()))
            self._procs.append(proc)

    @property
    def size(self) -> int:
        return len(self._procs)

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def run(self, spec: LoadSpec, processes: int | None = None) -> LoadResult:
        """Run `spec` in the first `processes` clients (all by default), started together."""
        conns = self._conns[: processes or len(self._conns)]
        start_at = time.time() + 0.3
        for conn in conns:
            conn.send((spec, start_at))
        result = LoadResult(window_s=spec.duration_s)
        replies: list[Any] = [None] * len(conns)

        def receive(i: int) -> None:
            replies[i] = conns[i].recv()

        threads = [threading.Thread(target=receive, args=(i,)) for i in range(len(conns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for status, payload in replies:
            if status != "ok":
                raise RuntimeError(f"client process failed: {payload}")
            lat, errors, first_error, response, completed = payload
            result.latencies_ns.extend(lat)
            result.completed += completed
            result.errors += errors
            result.first_error = result.first_error or first_error
            result.last_response = response or result.last_response
        return result

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(None)
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description="a load-generator client process (started by ClientPool)")
    parser.add_argument("--fd", type=int, required=True)
    _client_main(Connection(parser.parse_args().fd))


if __name__ == "__main__":
    main()
