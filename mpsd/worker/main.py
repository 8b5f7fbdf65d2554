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
from typing import TYPE_CHECKING

from setproctitle import setproctitle

from mpsd import osfacts
from mpsd.ipc import protocol as p
from mpsd.ipc.dtypes import wire_to_config
from mpsd.ipc.framing import ConnectionClosed, FrameReader, recv_blocking, send_blocking
from mpsd.ipc.heap import keep_large_buffers_in_heap, settle_collector
from mpsd.worker.heartbeat import start_heartbeat
from mpsd.worker.inbox import Inbox
from mpsd.worker.parentwatch import watch_parent
from mpsd.worker.regions import Arenas

if TYPE_CHECKING:
    import torch

    from mpsd.worker.backends import Backend
    from mpsd.worker.inference import Runner


def _load(sock: socket.socket, init: p.Init, inbox: Inbox) -> tuple[Runner, Arenas]:
    """Select the device, load and warm up the model; report Ready or LoadFailed."""
    import torch

    from mpsd.worker.autocast import check_autocast
    from mpsd.worker.compiled import compile_warmup
    from mpsd.worker.device import DeviceUnavailable, select_device
    from mpsd.worker.host import limit_host_threads
    from mpsd.worker.inference import Runner
    from mpsd.worker.warmup import run_warmup

    spec = init.model
    t0 = time.perf_counter()
    try:
        dtypes = [wire_to_config(t.datatype) for t in (*spec.inputs, *spec.outputs)]
        device, info = select_device(init.kind, init.memory_fraction, dtypes, init.accelerator)
        setproctitle(f"mpsd: worker {spec.name}/{spec.version}#{init.instance} ({info.kind})")
        limit_host_threads(device)
        torch.set_grad_enabled(False)
        check_autocast(spec, device)
        backend, calls = _load_backend(spec, device, inbox)
        t1 = time.perf_counter()
        compile_ms = compile_warmup(spec, backend, device) if spec.compile_mode is not None else None
        # Zeros would reach the models it calls, which cannot be called before it serves: only configured
        # warm-up samples run (and fail, naming the call, if they call)
        run_warmup(spec, backend, device, default=not calls and not spec.sequence)
        t2 = time.perf_counter()
        backend, recorded = _record_cuda_graphs(spec, backend, device)
        t3 = time.perf_counter()
        arenas = _map_arenas(init.arenas, device)
        runner = Runner(spec, backend, device)
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
            calls,
            runner.overlaps,
            settle_collector(),  # loaded and warm: what it holds now, it holds until it ends
        ),
    )
    return runner, arenas


def _load_backend(spec: p.ModelSpec, device: torch.device, inbox: Inbox) -> tuple[Backend, bool]:
    """The model on `device`, wrapped as its config asks (torch.compile, autocast, sequence state), and
    whether it calls other models."""
    from mpsd.worker.autocast import AutocastBackend
    from mpsd.worker.calls import Models, install
    from mpsd.worker.compiled import compile_backend
    from mpsd.worker.op_libraries import load_model
    from mpsd.worker.sequence_state import StateKeeper, model_facing_spec

    install(Models(inbox, device))  # what a python model that calls other models gets
    backend = load_model(model_facing_spec(spec), device)
    calls = bool(getattr(backend, "calls_models", False))
    if spec.compile_mode is not None:
        compile_backend(backend, spec)
    if spec.autocast is not None:
        backend = AutocastBackend(backend, spec, device)
    if spec.states:
        backend = StateKeeper(backend, spec, device)
    return backend, calls


def _record_cuda_graphs(
    spec: p.ModelSpec, backend: Backend, device: torch.device
) -> tuple[Backend, tuple[int, ...]]:
    """The backend replaying CUDA graphs recorded at the configured batch sizes, and those sizes; the
    backend as it is off CUDA or when none are configured."""
    if not (spec.cuda_graph_batch_sizes and device.type == "cuda"):
        return backend, ()
    import torch

    from mpsd.worker.cuda_graphs import GraphedBackend

    with torch.inference_mode():
        graphed = GraphedBackend(backend, spec, device)
    return graphed, graphed.sizes


def _map_arenas(refs: tuple[p.ArenaRef, ...], device: torch.device) -> Arenas:
    """The fronts' arenas this worker inherited, mapped (and page-locked on CUDA) before it says Ready: a
    failure is a failed load with its reason, not a worker that dies serving."""
    from mpsd.worker.host import host_pinner

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


SMALL_MACHINE_CPUS = 4
SNAPSHOT_INTERVAL_S = 5.0  # memory counters to the daemon at least this often


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
    if "OMP_WAIT_POLICY" in os.environ or osfacts.usable_cpus() > SMALL_MACHINE_CPUS:
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
    inbox = Inbox(sock, FrameReader(sock, SNAPSHOT_INTERVAL_S / 5))
    try:
        runner, arenas = _load(sock, init, inbox)
        from mpsd.worker.serve import Serving

        Serving(
            sock,
            runner,
            SNAPSHOT_INTERVAL_S,
            after_request=init.snapshot_after_request,
            arenas=arenas,
            inbox=inbox,
        ).run()
    except Exception:
        traceback.print_exc()
        return 1
    return p.EXIT_OK
