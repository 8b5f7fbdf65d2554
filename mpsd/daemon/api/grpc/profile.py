"""Admin `Profile`: one worker of a model profiles its executions for a bounded window while it goes on
serving, and the result streams back to the caller (never to a file the caller names on the server).

The window is the worker's to count in requests and the daemon's to time: the daemon sends StopProfile
when `seconds` are up (with a request window too, as its upper bound), or as soon as the caller goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import structlog

from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.registry import Registry
from mpsd.daemon.supervise.worker.handle import WorkerProcess
from mpsd.errors import Internal, InvalidArgument, MpsdError, NotFound, Unavailable
from mpsd.ipc import protocol as p
from mpsd.proto import admin_pb2 as pb

log = structlog.get_logger("mpsd.daemon.api.grpc.profile")

MAX_SECONDS = 300.0
MAX_REQUESTS = 100_000
# A request window stays open at most this long unless `seconds` says otherwise.
DEFAULT_REQUEST_WINDOW_S = 60.0
# How long the worker has to answer StartProfile (it answers between executions).
START_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Window:
    seconds: float
    requests: int


def window(seconds: float, requests: int) -> Window:
    """The bounded window a request asks for; InvalidArgument naming the bound otherwise."""
    if math.isnan(seconds) or seconds < 0 or seconds > MAX_SECONDS:
        raise InvalidArgument(f"seconds must be between 0 and {MAX_SECONDS:g} (got {seconds:g})")
    if requests > MAX_REQUESTS:
        raise InvalidArgument(f"requests must be at most {MAX_REQUESTS} (got {requests})")
    if requests == 0 and seconds == 0:
        raise InvalidArgument("give the window: seconds (up to 300) or requests (then seconds is its limit)")
    return Window(seconds or DEFAULT_REQUEST_WINDOW_S, requests)


def _worker(mv: ModelVersion, instance: int) -> WorkerProcess:
    if instance >= len(mv.instances):
        raise NotFound(
            f"model '{mv.name}' version {mv.version} has {len(mv.instances)} instance(s); "
            f"no instance {instance}"
        )
    chosen = mv.instances[instance]
    worker = chosen.worker
    if worker is None or not chosen.ready:
        raise Unavailable(f"model '{mv.name}' version {mv.version} instance {instance} is not running")
    return worker


def _started(worker: WorkerProcess, msg: p.ProfileStarted) -> Any:
    device = worker.ready.device.get("kind") if worker.ready is not None else ""
    return pb.ProfileEvent(
        started=pb.ProfileStartedEvent(
            worker=worker.launch.label, pid=worker.pid or 0, device=str(device or ""), kind=msg.kind
        )
    )


async def profile(registry: Registry, request: Any) -> AsyncIterator[Any]:
    """The ProfileEvent messages of one profile: started, the data chunks, done."""
    bounds = window(request.seconds, request.requests)
    mv = registry.route(request.model, str(request.version) if request.version else "")
    worker = _worker(mv, request.instance)
    channel = worker.channel
    run = channel.start_profile(bounds.requests, request.mps_gpu_trace)
    loop = asyncio.get_running_loop()
    timer: asyncio.TimerHandle | None = None
    try:
        first = await asyncio.wait_for(run.next(), START_TIMEOUT_S)
        if isinstance(first, p.ProfileFailed):
            raise Unavailable(f"{worker.launch.label}: the profile could not start: {first.reason}")
        if isinstance(first, MpsdError):
            raise first
        if not isinstance(first, p.ProfileStarted):
            raise Internal(f"protocol error: {type(first).__name__} before ProfileStarted")
        log.info(
            "profile started",
            worker=worker.launch.label,
            pid=worker.pid,
            seconds=bounds.seconds,
            requests=bounds.requests,
        )
        yield _started(worker, first)
        timer = loop.call_later(bounds.seconds, channel.stop_profile, run)
        while True:
            item = await run.next()
            if isinstance(item, MpsdError):
                raise item
            if isinstance(item, p.ProfileFailed):
                raise Unavailable(f"{worker.launch.label}: profiling failed: {item.reason}")
            if isinstance(item, p.ProfileChunk):
                yield pb.ProfileEvent(data=pb.ProfileData(name=item.name, data=item.data))
            elif isinstance(item, p.ProfileDone):
                log.info(
                    "profile done",
                    worker=worker.launch.label,
                    pid=worker.pid,
                    requests=item.requests,
                    ended_by=item.ended_by,
                )
                yield pb.ProfileEvent(
                    done=pb.ProfileDoneEvent(
                        requests=item.requests,
                        executions=item.executions,
                        seconds=item.seconds,
                        ended_by="seconds" if item.ended_by == "stopped" else item.ended_by,
                        notes=list(item.notes),
                    )
                )
                return
    except TimeoutError:
        why = f"did not start profiling within {START_TIMEOUT_S:g} s"
        raise Unavailable(f"{worker.launch.label} {why}") from None
    finally:
        if timer is not None:
            timer.cancel()
        with contextlib.suppress(Exception):
            channel.end_profile(run)
