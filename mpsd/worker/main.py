"""The worker process: load one model version on one device, then serve requests from the daemon.

Started by exec (`python -m mpsd.worker --fd N --beat-fd B --parent-pid P`), never by fork. Everything that
touches the device runs on the main thread.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING

from setproctitle import setproctitle

from mpsd.errors import ErrorCode, MpsdError
from mpsd.ipc import protocol as p
from mpsd.ipc.dtypes import wire_to_config
from mpsd.ipc.framing import ConnectionClosed, FrameReader, recv_blocking, send_blocking
from mpsd.ipc.heap import keep_large_buffers_in_heap
from mpsd.ipc.shm import Region
from mpsd.worker.heartbeat import start_heartbeat
from mpsd.worker.parentwatch import watch_parent
from mpsd.worker.regions import Arenas, RegionCache

if TYPE_CHECKING:
    import torch

    from mpsd.worker.inference import Prepared, Runner


def _load(sock: socket.socket, init: p.Init) -> tuple[Runner, Arenas]:
    """Select the device, load and warm up the model; report Ready or LoadFailed."""
    import torch

    from mpsd.worker.autocast import AutocastBackend, check_autocast
    from mpsd.worker.compiled import compile_backend, compile_warmup
    from mpsd.worker.device import DeviceUnavailable, limit_host_threads, select_device
    from mpsd.worker.inference import run_warmup
    from mpsd.worker.op_libraries import load_model

    spec = init.model
    t0 = time.perf_counter()
    try:
        dtypes = [wire_to_config(t.datatype) for t in (*spec.inputs, *spec.outputs)]
        device, info = select_device(init.kind, init.memory_fraction, dtypes, init.accelerator)
        setproctitle(f"mpsd: worker {spec.name}/{spec.version}#{init.instance} ({info.kind})")
        limit_host_threads(device)
        torch.set_grad_enabled(False)
        check_autocast(spec, device)
        backend = load_model(spec, device)
        if spec.compile_mode is not None:
            compile_backend(backend, spec)
        if spec.autocast is not None:
            backend = AutocastBackend(backend, spec, device)
        t1 = time.perf_counter()
        compile_ms = compile_warmup(spec, backend, device) if spec.compile_mode is not None else None
        run_warmup(spec, backend, device)
        t2 = time.perf_counter()
        recorded: tuple[int, ...] = ()
        if spec.cuda_graph_batch_sizes and device.type == "cuda":
            from mpsd.worker.cuda_graphs import GraphedBackend

            with torch.inference_mode():
                graphed = GraphedBackend(backend, spec, device)
            backend, recorded = graphed, graphed.sizes
        t3 = time.perf_counter()
        arenas = _map_arenas(init.arenas, device)
    except DeviceUnavailable as exc:
        _fail_load(sock, str(exc))
    except Exception as exc:
        _fail_load(sock, f"{type(exc).__name__}: {exc}")
    send_blocking(
        sock,
        p.Ready(
            os.getpid(),
            info.as_dict(),
            (t1 - t0) * 1e3,
            (t2 - t1) * 1e3,
            recorded,
            (t3 - t2) * 1e3,
            compile_ms,
        ),
    )
    from mpsd.worker.inference import Runner

    return Runner(spec, backend, device), arenas


def _map_arenas(refs: tuple[p.ArenaRef, ...], device: torch.device) -> Arenas:
    """The fronts' arenas this worker inherited, mapped (and page-locked on CUDA) before it says Ready: a
    failure is a failed load with its reason, not a worker that dies serving."""
    from mpsd.worker.device import host_pinner

    try:
        return Arenas(refs, host_pinner(device))
    except OSError as exc:
        raise RuntimeError(
            f"mapping the front processes' arenas failed ({exc}); the daemon's `arenas_to_workers: false` "
            "keeps workers out of them"
        ) from None


def _fail_load(sock: socket.socket, reason: str) -> None:
    try:
        send_blocking(sock, p.LoadFailed(reason))
    finally:
        sys.stderr.flush()
        os._exit(p.EXIT_LOAD_FAILED)


# Each slot's regions, by role name in the region cache.
_INPUT_ROLES = tuple(f"input{slot}" for slot in range(p.SLOTS))
_OUTPUT_ROLES = tuple(f"output{slot}" for slot in range(p.SLOTS))


def _infer(
    reader: FrameReader,
    sock: socket.socket,
    runner: Runner,
    regions: RegionCache,
    msg: p.Infer,
    early: deque[object],
    arenas: Arenas | None = None,
    ahead: dict[int, Prepared] | None = None,
) -> p.InferDone:
    """Run one request from shared memory to shared memory (the regions of its slot).

    Messages that arrive while it waits for a larger output region (the daemon's next request) go to
    `early`, to be handled after it. With `ahead`, the inputs of the next execution are built while the
    device runs this one (`_prepare_next`), and this one's are taken from there when they were.
    """
    from mpsd.worker.inference import write_outputs

    waited_ns = max(0, time.monotonic_ns() - msg.sent_ns) if msg.sent_ns else 0
    prepared = ahead.pop(msg.req_id, None) if ahead is not None else None
    inputs = regions.get(_INPUT_ROLES[msg.slot], msg.input_region)
    abandoned = inputs.buf[0]  # the slot's control block: nobody waits for this execution any more
    if abandoned == p.ABANDONED_EXPIRED:
        raise MpsdError(
            "every request of the batch was past its deadline before it ran", ErrorCode.DEADLINE_EXCEEDED
        )
    if abandoned:
        raise MpsdError("every request of the batch was cancelled before it ran", ErrorCode.CANCELLED)
    inputs.buf[0] = p.STARTED
    if runner.spec.decoupled:
        return _stream(reader, sock, runner, regions, msg, early, inputs, waited_ns, arenas)
    meanwhile = None
    if ahead is not None:
        table = ahead

        def meanwhile() -> None:
            _prepare_next(reader, runner, regions, early, arenas, table)

    outputs, in_ns, infer_ns, device_ns = runner.compute(
        inputs, msg.inputs, regions.views(_INPUT_ROLES[msg.slot]), msg.pieces, arenas, prepared, meanwhile
    )
    t0 = time.perf_counter_ns()
    tensors = runner.prepare_outputs(outputs, msg.outputs)
    del outputs
    needed = sum(t.numel() * t.element_size() for t in tensors)
    out_ref = _output_region(reader, sock, msg, msg.output_region, needed, early)
    refs = write_outputs(regions.get(_OUTPUT_ROLES[msg.slot], out_ref), msg.outputs, tensors)
    output_ns = time.perf_counter_ns() - t0
    return p.InferDone(msg.req_id, refs, in_ns, infer_ns, output_ns, waited_ns, device_ns)


def _prepare_next(
    reader: FrameReader,
    runner: Runner,
    regions: RegionCache,
    early: deque[object],
    arenas: Arenas | None,
    ahead: dict[int, Prepared],
) -> None:
    """While the device runs an execution: if the next message is here and is an execution, build its
    inputs now (queueing their copies to the device behind this one's work), so the device waits less for
    the host between the two. Only building: whether it runs (cancelled, past its deadline) is decided
    when its turn comes, as for any other; a failure here is left for that turn to meet and report."""
    if not early:
        try:
            message = reader.poll()
        except ConnectionClosed:
            return  # the serving loop meets the closed socket on its next read
        if message is None:
            return
        early.append(message)
    msg = early[0]
    if not isinstance(msg, p.Infer) or runner.spec.decoupled:
        return
    t0 = time.perf_counter_ns()
    try:
        region = regions.get(_INPUT_ROLES[msg.slot], msg.input_region)
        if region.buf[0]:  # nobody waits for it any more: it will not run
            return
        views = regions.views(_INPUT_ROLES[msg.slot])
        inputs = runner.inputs(region, msg.inputs, views, msg.pieces, arenas)
    except Exception:
        return
    ahead[msg.req_id] = (inputs, time.perf_counter_ns() - t0)


def _output_region(
    reader: FrameReader,
    sock: socket.socket,
    msg: p.Infer,
    current: p.RegionRef,
    needed: int,
    early: deque[object],
) -> p.RegionRef:
    """The slot's output region, asking the daemon for a larger one when `needed` bytes do not fit."""
    if needed <= current.size:
        return current
    send_blocking(sock, p.NeedOutput(msg.req_id, needed))
    while not isinstance(reply := reader.recv_wait(), p.OutputRegion):
        early.append(reply)
    return reply.region


def _stream(
    reader: FrameReader,
    sock: socket.socket,
    runner: Runner,
    regions: RegionCache,
    msg: p.Infer,
    early: deque[object],
    inputs: Region,
    waited_ns: int,
    arenas: Arenas | None = None,
) -> p.InferDone:
    """A decoupled model's request: each response goes to the daemon as a StreamPart through the slot's
    output region, and the model is resumed only once the daemon acknowledges it (so a slow client holds
    the model back); a `stop` in the acknowledgement closes the model's generator. The InferDone at the
    end carries no outputs: it is the final flag."""
    from mpsd.worker.inference import write_outputs

    t0 = time.perf_counter_ns()
    out_ref = msg.output_region
    views = regions.views(_INPUT_ROLES[msg.slot])
    parts = runner.compute_stream(inputs, msg.inputs, views, msg.pieces, arenas)
    index = 0
    try:
        for outputs in parts:
            tensors = runner.prepare_outputs(outputs, msg.outputs)
            del outputs
            needed = sum(t.numel() * t.element_size() for t in tensors)
            out_ref = _output_region(reader, sock, msg, out_ref, needed, early)
            refs = write_outputs(regions.get(_OUTPUT_ROLES[msg.slot], out_ref), msg.outputs, tensors)
            send_blocking(sock, p.StreamPart(msg.req_id, index, refs))
            while not (isinstance(ack := reader.recv_wait(), p.StreamAck) and ack.req_id == msg.req_id):
                early.append(ack)
            index += 1
            if ack.stop:
                raise MpsdError(f"the stream was stopped after {index} responses", ErrorCode.CANCELLED)
    finally:
        parts.close()  # the model's generator: its `finally` runs now
    return p.InferDone(msg.req_id, (), 0, time.perf_counter_ns() - t0, 0, waited_ns, None)


def _serve(
    sock: socket.socket,
    runner: Runner,
    snapshot_interval_s: float = 5.0,
    after_request: bool = False,
    arenas: Arenas | None = None,
) -> None:
    """Answer requests until the daemon says Shutdown or goes away.

    Runs under inference mode, entered once here rather than per request. Between requests, and at least
    every fifth of the snapshot interval while idle, memory counters are sent when they are due.
    """
    import torch

    from mpsd.worker.device import host_pinner, is_out_of_memory, memory_counters, release_cached_memory
    from mpsd.worker.profiling import Profiler

    pin = host_pinner(runner.device)
    regions = RegionCache(pin)
    arenas = arenas if arenas is not None else Arenas(())
    # The next execution's inputs, built while the device runs the current one (a device that runs the model
    # asynchronously; on the CPU the model's call returns when its work is done).
    ahead: dict[int, Prepared] | None = None if runner.device.type == "cpu" else {}
    reader = FrameReader(sock, snapshot_interval_s / 5)
    early: deque[object] = deque()
    last_snapshot = 0.0
    profiler = Profiler(runner.device, lambda m: send_blocking(sock, m))
    with torch.inference_mode():
        while True:
            if time.monotonic() - last_snapshot >= snapshot_interval_s:
                # Counters are read on this (the device) thread, between requests, never during one.
                send_blocking(sock, p.MemorySnapshot(memory_counters(runner.device)))
                last_snapshot = time.monotonic()
            try:
                msg = early.popleft() if early else reader.recv()
            except ConnectionClosed:
                return
            if isinstance(msg, p.Infer):
                failure: p.InferFailed | None = None
                oom = False
                try:
                    send_blocking(sock, _infer(reader, sock, runner, regions, msg, early, arenas, ahead))
                    if after_request:
                        last_snapshot = 0.0
                except ConnectionClosed:
                    return
                except MpsdError as exc:
                    failure = p.InferFailed(msg.req_id, exc.code.value, exc.message)
                except Exception as exc:
                    oom = is_out_of_memory(exc)
                    code = ErrorCode.RESOURCE_EXHAUSTED if oom else ErrorCode.INTERNAL
                    failure = p.InferFailed(msg.req_id, code.value, f"{type(exc).__name__}: {exc}")
                if failure is not None:
                    if oom:  # outside the except block, so the traceback no longer pins the request's tensors
                        release_cached_memory(runner.device)
                        last_snapshot = 0.0
                    send_blocking(sock, failure)
                profiler.executed(msg.requests)
            elif isinstance(msg, p.ForgetArena):
                arenas.forget(msg.arena_id)
            elif isinstance(msg, p.StartProfile):
                profiler.start(msg)
            elif isinstance(msg, p.StopProfile):
                profiler.stop(msg.profile_id)
            elif isinstance(msg, p.Shutdown):
                profiler.stop(profiler.profile_id)
                return


SMALL_MACHINE_CPUS = 4


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def _bound_openmp_spinning() -> None:
    """Before torch loads OpenMP, on machines of at most SMALL_MACHINE_CPUS CPUs: idle OpenMP threads spin
    briefly, then sleep.

    By default they spin for milliseconds after each parallel region (libgomp: 300,000 pauses; LLVM libomp:
    200 ms). Where the worker's OpenMP team covers the few cores the daemon's event loop and gRPC threads
    also need, that spinning starves them: a 600 KB identity request cost 10 ms of worker CPU instead of
    0.5 ms, and its latency went from 3.5 ms to 17 ms, on a two-core machine. On a 16-core host the short
    spin made a 16-thread CNN up to 3.6x slower at batch 1 (threads sleep and must be woken for every
    operator), so larger machines keep torch's defaults. Explicit settings win.
    """
    if "OMP_WAIT_POLICY" in os.environ or _usable_cpus() > SMALL_MACHINE_CPUS:
        return
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    os.environ.setdefault("KMP_BLOCKTIME", "1")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpsd-worker", description="mpsd worker process (started by mpsd)")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket to the daemon")
    parser.add_argument("--beat-fd", type=int, required=True, help="inherited datagram socket for heartbeats")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    _bound_openmp_spinning()
    keep_large_buffers_in_heap()  # outputs allocated and freed on every request
    # The daemon stops workers with a Shutdown message or SIGTERM; Ctrl-C in a terminal goes to the daemon.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    watch_parent(args.parent_pid)
    for fd in (args.fd, args.beat_fd):
        os.set_inheritable(fd, False)  # processes the model may start must not hold our channels open
    sock = socket.socket(fileno=args.fd)
    beats = socket.socket(fileno=args.beat_fd)
    try:
        init = recv_blocking(sock)
    except ConnectionClosed:
        return p.EXIT_PARENT_GONE
    if not isinstance(init, p.Init):
        return p.EXIT_PROTOCOL_ERROR
    # Named in ps and Activity Monitor by role and model (the device is added once it is chosen).
    setproctitle(f"mpsd: worker {init.model.name}/{init.model.version}#{init.instance}")
    start_heartbeat(beats, init.heartbeat_interval_s)
    try:
        runner, arenas = _load(sock, init)
        _serve(sock, runner, after_request=init.snapshot_after_request, arenas=arenas)
    except Exception:
        traceback.print_exc()
        return 1
    return p.EXIT_OK
