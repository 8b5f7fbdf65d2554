"""The daemon's handle on one worker process: spawn, IPC, shared memory, death detection.

One request at a time per worker; the caller (the instance's dispatcher) guarantees that.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import signal
import socket
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import structlog

from mpsd.errors import Internal, MpsdError, Unavailable, error_from_code
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import ConnectionClosed, encode, recv_async
from mpsd.ipc.shm import Region, page_round

from .request import InputTensor, OutputTensor, Timings

log = structlog.get_logger("mpsd.daemon.worker")

ALIGN = 64
INITIAL_REGION = 1 << 20


class LoadError(Exception):
    """The worker could not load or warm up its model; the message is the reason shown to operators."""


class WorkerDied(Unavailable):
    """The worker process ended while a request was in flight."""


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

    @property
    def label(self) -> str:
        return f"{self.model.name}/{self.model.version}#{self.instance}"


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class WorkerProcess:
    def __init__(self, launch: WorkerLaunch) -> None:
        self.launch = launch
        self.pid: int | None = None
        self.returncode: int | None = None
        self.ready: p.Ready | None = None
        self.memory: dict[str, int] = {}
        self.died = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader: asyncio.StreamReader | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._pending: asyncio.Future[object] | None = None
        self._req_ids = itertools.count(1)
        self._input: Region | None = None
        self._output: Region | None = None
        self._regions: list[Region] = []
        self._stopping = False

    @property
    def exit_description(self) -> str:
        return describe_exit(self.returncode)

    async def start(self, timeout_s: float) -> p.Ready:
        """Spawn (exec, never fork), send Init, wait for Ready; raises LoadError with the reason."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mpsd.worker",
                "--fd",
                str(child_sock.fileno()),
                "--parent-pid",
                str(os.getpid()),
                pass_fds=(child_sock.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(self.launch.env),
            )
        finally:
            child_sock.close()
        self.pid = self._proc.pid
        self._reader, self._writer = await asyncio.open_unix_connection(sock=parent_sock)
        log.info("worker started", worker=self.launch.label, pid=self.pid, kind=self.launch.kind)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._tasks.append(asyncio.create_task(self._pump_output(self._proc.stdout, "stdout")))
        self._tasks.append(asyncio.create_task(self._pump_output(self._proc.stderr, "stderr")))
        init = p.Init(self.launch.model, self.launch.instance, self.launch.kind, self.launch.memory_fraction)
        self._writer.write(encode(init))
        try:
            reply = await asyncio.wait_for(recv_async(self._reader), timeout_s)
        except (ConnectionClosed, TimeoutError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            await self.kill()
            if timed_out:
                raise LoadError(f"worker did not become ready within {timeout_s:g} s") from None
            raise LoadError(f"worker {self.exit_description} while loading") from None
        if isinstance(reply, p.LoadFailed):
            await self._wait_exit(5.0)
            raise LoadError(reply.reason)
        if not isinstance(reply, p.Ready):
            await self.kill()
            raise LoadError(f"protocol error: unexpected {type(reply).__name__} during load")
        self.ready = reply
        self._tasks.append(asyncio.create_task(self._read_loop()))
        return reply

    async def _pump_output(self, stream: asyncio.StreamReader, name: str) -> None:
        """Every line a worker prints becomes a log event tagged with its model and pid."""
        level = log.info if name == "stdout" else log.warning
        while True:
            line = await stream.readline()
            if not line:
                return
            level(
                line.decode(errors="replace").rstrip(),
                source=f"worker.{name}",
                worker=self.launch.label,
                pid=self.pid,
            )

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                msg = await recv_async(self._reader)
                if isinstance(msg, p.NeedOutput):
                    self._grow_output(msg.nbytes)
                elif isinstance(msg, p.MemorySnapshot):
                    self.memory = msg.memory
                elif self._pending is not None and not self._pending.done():
                    self._pending.set_result(msg)
        except (ConnectionClosed, OSError):
            pass
        await self._wait_exit(None)
        if self._pending is not None and not self._pending.done():
            self._pending.set_exception(
                WorkerDied(
                    f"model '{self.launch.model.name}' version {self.launch.model.version}: worker pid "
                    f"{self.pid} {self.exit_description} while running the request"
                )
            )
        if not self._stopping:
            log.error("worker died", worker=self.launch.label, pid=self.pid, exit=self.exit_description)
        self._release_regions()
        self.died.set()

    async def _wait_exit(self, timeout_s: float | None) -> None:
        if self._proc is None:
            return
        try:
            self.returncode = await asyncio.wait_for(self._proc.wait(), timeout_s)
        except TimeoutError:
            await self.kill()

    def _grow_output(self, nbytes: int) -> None:
        old = self._output
        self._output = self._new_region(max(nbytes, 2 * (old.size if old else 0)))
        if old is not None:
            self._retire(old)
        assert self._writer is not None
        self._writer.write(encode(p.OutputRegion(p.RegionRef(self._output.name, self._output.size))))

    def _new_region(self, size: int) -> Region:
        region = Region.create(page_round(size))
        self._regions.append(region)
        return region

    def _retire(self, region: Region) -> None:
        region.unlink()
        if region.close():
            self._regions.remove(region)

    def _release_regions(self) -> None:
        for region in self._regions:
            region.unlink()
            region.close()
        self._regions.clear()
        self._input = self._output = None

    async def infer(
        self, inputs: Sequence[InputTensor], outputs: Sequence[str], timings: Timings
    ) -> tuple[OutputTensor, ...]:
        """Run one request: write inputs into shared memory, wait for the worker, read outputs back."""
        if self.died.is_set() or self._writer is None:
            raise WorkerDied(
                f"model '{self.launch.model.name}' version {self.launch.model.version}: worker is not running"
            )
        t0 = asyncio.get_running_loop().time()
        refs = []
        offset = 0
        for t in inputs:
            n = len(t.data)
            refs.append(p.TensorRef(t.name, t.datatype, t.shape, offset, n))
            offset = _align(offset + n)
        if self._input is None or self._input.size < offset:
            if self._input is not None:
                self._retire(self._input)
            self._input = self._new_region(
                max(offset, INITIAL_REGION, 2 * (self._input.size if self._input else 0))
            )
        buf = self._input.buf
        for ref, t in zip(refs, inputs, strict=True):
            buf[ref.offset : ref.offset + ref.nbytes] = t.data
        if self._output is None:
            self._output = self._new_region(INITIAL_REGION)
        write_ns = int((asyncio.get_running_loop().time() - t0) * 1e9)
        req_id = next(self._req_ids)
        msg = p.Infer(
            req_id,
            tuple(refs),
            tuple(outputs),
            p.RegionRef(self._input.name, self._input.size),
            p.RegionRef(self._output.name, self._output.size),
        )
        self._pending = asyncio.get_running_loop().create_future()
        self._writer.write(encode(msg))
        try:
            reply = await self._pending
        finally:
            self._pending = None
        if isinstance(reply, p.InferFailed):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, p.InferDone) or reply.req_id != req_id:
            raise Internal(f"protocol error: unexpected reply {type(reply).__name__} from worker")
        # The worker has mapped both regions now: their names are no longer needed.
        self._input.unlink()
        out = self._output
        assert out is not None
        out.unlink()
        r0 = asyncio.get_running_loop().time()
        result = tuple(
            OutputTensor(
                ref.name, ref.datatype, ref.shape, bytes(out.buf[ref.offset : ref.offset + ref.nbytes])
            )
            for ref in reply.outputs
        )
        read_ns = int((asyncio.get_running_loop().time() - r0) * 1e9)
        timings.compute_input_ns = write_ns + reply.compute_input_ns
        timings.compute_infer_ns = reply.compute_infer_ns
        timings.compute_output_ns = reply.compute_output_ns + read_ns
        return result

    async def stop(self, timeout_s: float) -> None:
        """Ask the worker to exit; TERM, then KILL if it does not."""
        self._stopping = True
        if self._proc is None or self.died.is_set():
            return
        if self._writer is not None:
            with contextlib.suppress(Exception):
                self._writer.write(encode(p.Shutdown()))
        for sig, wait in ((None, timeout_s), (signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
            if sig is not None and self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.send_signal(sig)
            try:
                await asyncio.wait_for(asyncio.shield(self.died.wait()), wait)
                break
            except TimeoutError:
                continue
        self._close()
        log.info("worker stopped", worker=self.launch.label, pid=self.pid, exit=self.exit_description)

    async def kill(self) -> None:
        self._stopping = True
        if self._proc is not None and self._proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()
            self.returncode = await self._proc.wait()
        self._close()

    def _close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._release_regions()


__all__ = ["LoadError", "MpsdError", "WorkerDied", "WorkerLaunch", "WorkerProcess", "describe_exit"]
