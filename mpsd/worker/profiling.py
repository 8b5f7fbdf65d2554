"""Profiling one worker on demand (`mpsd profile`): started and stopped between executions, on the worker's
one thread, while it goes on serving.

- CUDA and the CPU: `torch.profiler` with `record_shapes=True`; the Chrome trace is written to a file in a
  private temporary directory, read back and deleted, then sent to the daemon in chunks. Nothing is written
  where a client could choose.
- MPS: `torch.mps.profiler.start(mode, wait_until_completed)` / `stop()` around the same window, which emit
  os_signposts for Instruments; nothing comes back but how to record them (the worker's pid). Where
  `torch.mps.profiler.metal_capture` exists and Metal capture is enabled (MTL_CAPTURE_ENABLED=1), a GPU
  trace can be asked for too: it is zipped and sent back like a Chrome trace.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from mpsd.ipc import protocol as p

Send = Callable[[object], None]
# torch.mps.profiler's modes; "interval" traces each operation's duration.
MPS_MODE = "interval"


class Session(Protocol):
    """One running profile of one kind."""

    kind: str

    def stop(self) -> Iterator[tuple[str, bytes]]:
        """End the profile; the result's files as (name, bytes)."""
        ...

    def notes(self) -> tuple[str, ...]: ...


class TorchSession:
    """torch.profiler on the CPU (and CUDA on a CUDA device), shapes recorded."""

    kind = "torch"

    def __init__(self, device: torch.device) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        self._profile = profile(activities=activities, record_shapes=True)
        self._profile.start()

    def stop(self) -> Iterator[tuple[str, bytes]]:
        self._profile.stop()
        private = tempfile.mkdtemp(prefix="mpsd-profile-")  # mode 0700: only this user reads it
        try:
            path = os.path.join(private, "trace.json")
            self._profile.export_chrome_trace(path)
            data = Path(path).read_bytes()
        finally:
            shutil.rmtree(private, ignore_errors=True)
        yield "trace.json", data

    def notes(self) -> tuple[str, ...]:
        return ()


class MpsSession:
    """torch.mps.profiler's os_signposts around the window; optionally a Metal GPU trace (`metal_capture`).

    `api` is `torch.mps.profiler` (a stand-in in tests, where no Apple GPU is present).
    """

    kind = "mps"

    def __init__(self, api: Any, gpu_trace: bool) -> None:
        self._api = api
        self._capture: contextlib.ExitStack | None = None
        self._dir: str | None = None
        if gpu_trace:
            if not hasattr(api, "metal_capture"):
                raise RuntimeError(
                    f"torch {torch.__version__} has no torch.mps.profiler.metal_capture: a GPU trace needs "
                    "a newer torch (the signposts work without it)"
                )
            if not api.is_metal_capture_enabled():
                raise RuntimeError(
                    "Metal capture is not enabled in this worker: start the daemon with "
                    "MTL_CAPTURE_ENABLED=1 in its environment to ask for a GPU trace"
                )
        api.start(mode=MPS_MODE, wait_until_completed=False)
        if gpu_trace:
            self._dir = tempfile.mkdtemp(prefix="mpsd-profile-")
            self._capture = contextlib.ExitStack()
            try:
                self._capture.enter_context(api.metal_capture(os.path.join(self._dir, "model.gputrace")))
            except BaseException:
                api.stop()
                shutil.rmtree(self._dir, ignore_errors=True)
                raise

    def stop(self) -> Iterator[tuple[str, bytes]]:
        try:
            if self._capture is not None:
                self._capture.close()  # metal_capture synchronizes, then stops the capture
        finally:
            self._api.stop()
        if self._dir is None:
            return
        try:
            yield "model.gputrace.zip", _zip(Path(self._dir))
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def notes(self) -> tuple[str, ...]:
        pid = os.getpid()
        return (
            f"the MPS signposts of worker pid {pid} were emitted during the window (mode {MPS_MODE}); "
            "they are recorded on the Mac itself, not sent back:",
            f"  xcrun xctrace record --template 'Metal System Trace' --attach {pid} --time-limit 30s "
            "(then run mpsd profile again within the recording and open the .trace in Instruments; "
            "xctrace and Instruments come with the full Xcode, not the Command Line Tools: install Xcode "
            "and `sudo xcode-select -s /Applications/Xcode.app`)",
            f"  or Instruments > Metal System Trace (or Logging) > choose process {pid} > record, then run "
            "mpsd profile; the PyTorch MPS intervals appear under os_signpost / Points of Interest",
        )


def _zip(root: Path) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for path in sorted(root.rglob("*")):
            if path.is_file():
                archive.write(path, path.relative_to(root))
    return buffer.getvalue()


def open_session(device: torch.device, gpu_trace: bool, mps_api: Any = None) -> Session:
    if device.type == "mps":
        if mps_api is None:
            import torch.mps.profiler as mps_api
        return MpsSession(mps_api, gpu_trace)
    if gpu_trace:
        raise RuntimeError(f"a Metal GPU trace is for MPS devices; this worker runs on {device.type}")
    return TorchSession(device)


class Profiler:
    """At most one profile at a time; the serving loop calls `start`, `executed` after each execution, and
    `stop`, all between executions."""

    def __init__(self, device: torch.device, send: Send, mps_api: Any = None) -> None:
        self.device = device
        self._send = send
        self._mps_api = mps_api
        self._session: Session | None = None
        self._id = 0
        self._limit = 0
        self._requests = 0
        self._executions = 0
        self._t0 = 0.0

    @property
    def profile_id(self) -> int:
        """The running profile's id (0 when none)."""
        return self._id if self._session is not None else 0

    def start(self, msg: p.StartProfile) -> None:
        if self._session is not None:
            self._send(p.ProfileFailed(msg.profile_id, "this worker is already being profiled"))
            return
        try:
            session = open_session(self.device, msg.mps_gpu_trace, self._mps_api)
        except Exception as exc:
            self._send(p.ProfileFailed(msg.profile_id, f"{type(exc).__name__}: {exc}"))
            return
        self._session = session
        self._id, self._limit = msg.profile_id, msg.requests
        self._requests = self._executions = 0
        self._t0 = time.monotonic()
        self._send(p.ProfileStarted(msg.profile_id, session.kind))

    def executed(self, requests: int) -> None:
        """After an execution (answered or failed): counts it, and ends the window at the request limit."""
        if self._session is None:
            return
        self._requests += requests
        self._executions += 1
        if self._limit and self._requests >= self._limit:
            self.stop(self._id, "requests")

    def stop(self, profile_id: int, ended_by: str = "stopped") -> None:
        session = self._session
        if session is None or profile_id != self._id:
            return  # ended already (its request limit came first)
        self._session = None
        seconds = time.monotonic() - self._t0
        try:
            for name, data in session.stop():
                step = p.PROFILE_CHUNK_BYTES
                for offset in range(0, max(len(data), 1), step):
                    self._send(p.ProfileChunk(profile_id, name, data[offset : offset + step]))
        except Exception as exc:
            self._send(p.ProfileFailed(profile_id, f"{type(exc).__name__}: {exc}"))
            return
        self._send(
            p.ProfileDone(profile_id, self._requests, self._executions, seconds, ended_by, session.notes())
        )
