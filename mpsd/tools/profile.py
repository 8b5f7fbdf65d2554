"""`mpsd profile`: profile one worker of a running model while it serves, and save what comes back.

The daemon streams the result (admin Profile); this writes it on the client's side: the Chrome trace to
`--out` (open it in Perfetto, https://ui.perfetto.dev, or chrome://tracing), a Metal GPU trace beside it.
On MPS nothing but the notes comes back: the worker emits os_signposts, which Instruments records on the
Mac itself (docs/devices.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import IO, Any

from mpsd.connect import open_channel
from mpsd.tools.common import ToolError

# Seconds beyond the window the call may take: starting, exporting and sending the trace.
SLACK_S = 120.0


def default_out(model: str) -> Path:
    return Path(f"{model}-profile-{time.strftime('%Y%m%d-%H%M%S')}.json")


def _path_for(out: Path, name: str) -> Path:
    """Where a file of the result goes: the trace at `out`, anything else beside it."""
    if name == "trace.json":
        return out
    return out.with_name(f"{out.stem}.{name}")


def run(
    conn: argparse.Namespace,
    model: str,
    version: int,
    instance: int,
    seconds: float | None,
    requests: int | None,
    out: Path | None,
    mps_gpu_trace: bool,
) -> int:
    from mpsd.proto import admin_pb2, admin_pb2_grpc

    if seconds is None and requests is None:
        raise ToolError("give the window", "--seconds N or --requests N")
    out = out if out is not None else default_out(model)
    request = admin_pb2.ProfileRequest(
        model=model,
        version=version,
        instance=instance,
        seconds=seconds or 0.0,
        requests=requests or 0,
        mps_gpu_trace=mps_gpu_trace,
    )
    limit = (seconds or 60.0) + SLACK_S
    files: dict[str, IO[bytes]] = {}
    written: list[Path] = []
    with open_channel(conn) as channel:
        stub = admin_pb2_grpc.MpsdAdminStub(channel)  # type: ignore[no-untyped-call]
        try:
            for event in stub.Profile(request, timeout=limit):
                which = event.WhichOneof("event")
                if which == "started":
                    _say_started(event.started, seconds, requests)
                elif which == "data":
                    handle = files.get(event.data.name)
                    if handle is None:
                        path = _path_for(out, event.data.name)
                        handle = files[event.data.name] = path.open("wb")
                        written.append(path)
                    handle.write(event.data.data)
                elif which == "done":
                    _say_done(event.done, written)
        finally:
            for handle in files.values():
                handle.close()
    return 0


def _say_started(started: Any, seconds: float | None, requests: int | None) -> None:
    window = f"{requests} requests" if requests else f"{seconds:g} s"
    print(
        f"profiling {started.worker} (pid {started.pid}, {started.device}) for {window}; it keeps serving",
        file=sys.stderr,
        flush=True,
    )


def _say_done(done: Any, written: list[Path]) -> None:
    print(
        f"window ended by {done.ended_by}: {done.requests} requests in {done.executions} executions over "
        f"{done.seconds:.2f} s",
        file=sys.stderr,
    )
    for note in done.notes:
        print(note, file=sys.stderr)
    for path in written:
        print(path)
    if any(p.suffix == ".json" for p in written):
        print(
            "open the trace in https://ui.perfetto.dev or chrome://tracing (shapes under each operator's "
            "'Input Dims')",
            file=sys.stderr,
        )
