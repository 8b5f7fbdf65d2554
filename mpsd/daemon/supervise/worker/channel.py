"""The daemon's handle on one worker process: spawn, IPC, shared memory, death detection.

At most `SLOTS` executions at a time per worker, each with its own input and output regions: the next
batch can wait in the worker's socket while the current one runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import structlog

from mpsd.daemon.supervise.child_output import output_lines
from mpsd.daemon.supervise.slot_regions import SlotRegions
from mpsd.daemon.supervise.slot_regions import ref as region_ref
from mpsd.errors import Internal, LoadError, WorkerDied, error_from_code
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import FrameProtocol, encode

log = structlog.get_logger("mpsd.daemon.worker")

T_co = TypeVar("T_co", covariant=True)


class Tensors(Protocol[T_co]):
    """One execution's tensors, laid out, written and read by the caller (`core.batching.marshal`): the
    worker's handle provides the slot's regions and calls these while it holds the slot."""

    @property
    def refs(self) -> tuple[p.TensorRef, ...]:
        """Each input's place in the input region, as `lay_out` set it."""
        ...

    def lay_out(self) -> int:
        """Place the inputs; returns the input region's size they need (control block included)."""
        ...

    def write(self, buf: memoryview) -> None:
        """Copy the inputs into the input region."""
        ...

    def outputs(self) -> tuple[str, ...]:
        """The outputs to compute."""
        ...

    def read(self, refs: Sequence[p.TensorRef], buf: memoryview) -> T_co:
        """The results, copied out of the output region where the worker's `refs` say they are."""
        ...


class PhaseTimes(Protocol):
    """Where an execution's time went, in nanoseconds (`core.request.Timings`)."""

    worker_wait_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int


class _Abandoned(Exception):
    """The caller stopped waiting (cancelled) while the worker still runs its execution."""

    def __init__(self, pending: asyncio.Future[object], cause: BaseException) -> None:
        self.pending = pending
        self.cause = cause


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
    max_device_memory_bytes: int | None = None
    max_rss_bytes: int | None = None
    gpu: int | None = None  # pinned: its index among the daemon's GPUs (the worker sees only it, as cuda:0)

    @property
    def label(self) -> str:
        return f"{self.model.name}/{self.model.version}#{self.instance}"


def _watch(
    control: memoryview,
    waiting: Sequence[asyncio.Future[Any]],
    deadline: float | None,
    loop: asyncio.AbstractEventLoop,
) -> Callable[[], None]:
    """Mark the execution abandoned in its control block (byte 0) once every future in `waiting` is done or
    the deadline passes; returns what stops watching. The worker skips an abandoned execution it has not
    started, so a request cancelled or expired while the previous batch runs does not run after all."""

    def mark(why: int) -> None:
        with contextlib.suppress(ValueError):  # the regions were released (the worker died)
            if control[0] == 0:
                control[0] = why

    def check(_: object = None) -> None:
        if waiting and all(f.done() for f in waiting):
            mark(p.ABANDONED_CANCELLED)

    for future in waiting:
        future.add_done_callback(check)
    timer = loop.call_at(deadline, mark, p.ABANDONED_EXPIRED) if deadline is not None else None

    def unwatch() -> None:
        for future in waiting:
            future.remove_done_callback(check)
        if timer is not None:
            timer.cancel()

    return unwatch


class WorkerProcess:
    def __init__(
        self, launch: WorkerLaunch, request_timeout_s: float = 0.0, heartbeat_timeout_s: float = 10.0
    ) -> None:
        self.launch = launch
        self.request_timeout_s = request_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.kill_reason = ""
        self.last_seen = 0.0
        self.over_ceiling = asyncio.Event()
        self.ceiling_reason = ""
        self._baseline_checked = False
        self.pid: int | None = None
        self.returncode: int | None = None
        self.ready: p.Ready | None = None
        self.memory: dict[str, int] = {}
        self.died = asyncio.Event()
        self._proc: asyncio.subprocess.Process | None = None
        self._transport: asyncio.Transport | None = None
        self._beats: socket.socket | None = None  # heartbeats from the worker, a datagram each
        self._load_reply: asyncio.Future[object] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._req_ids = itertools.count(1)
        # Up to p.SLOTS executions in flight, each with its own regions: the next batch waits in the
        # worker's socket while the current one runs.
        self.slots = tuple(SlotRegions() for _ in range(p.SLOTS))
        self._free_slots = list(range(p.SLOTS))[::-1]
        self._slot_freed = asyncio.Event()
        self._inflight: dict[int, tuple[asyncio.Future[object], int]] = {}  # req_id -> (answer, slot)
        self._stopping = False

    @property
    def exit_description(self) -> str:
        return describe_exit(self.returncode)

    async def start(self, timeout_s: float) -> p.Ready:
        """Spawn (exec, never fork), send Init, wait for Ready; raises LoadError with the reason."""
        parent_sock, child_sock = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        # Heartbeats have a channel of their own: the worker's main thread is then the only writer of its
        # socket and sends without a lock; a datagram is one beat, whole or not at all.
        beats, child_beats = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "mpsd.worker",
                "--fd",
                str(child_sock.fileno()),
                "--beat-fd",
                str(child_beats.fileno()),
                "--parent-pid",
                str(os.getpid()),
                pass_fds=(child_sock.fileno(), child_beats.fileno()),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=dict(self.launch.env),
            )
        except BaseException:
            beats.close()
            raise
        finally:
            child_sock.close()
            child_beats.close()
        self.pid = self._proc.pid
        loop = asyncio.get_running_loop()
        beats.setblocking(False)
        self._beats = beats
        loop.add_reader(beats.fileno(), self._on_beat)
        self._load_reply = loop.create_future()
        transport, _ = await loop.create_unix_connection(
            lambda: FrameProtocol(self._on_message, self._on_closed), sock=parent_sock
        )
        self._transport = transport
        log.info("worker started", worker=self.launch.label, pid=self.pid, kind=self.launch.kind)
        assert self._proc.stdout is not None and self._proc.stderr is not None
        self._tasks.append(asyncio.create_task(self._pump_output(self._proc.stdout, "stdout")))
        self._tasks.append(asyncio.create_task(self._pump_output(self._proc.stderr, "stderr")))
        beat = max(0.1, min(1.0, self.heartbeat_timeout_s / 5)) if self.heartbeat_timeout_s else 1.0
        init = p.Init(
            self.launch.model,
            self.launch.instance,
            self.launch.kind,
            self.launch.memory_fraction,
            heartbeat_interval_s=beat,
            snapshot_after_request=bool(self.launch.max_device_memory_bytes or self.launch.max_rss_bytes),
        )
        self._transport.write(encode(init))
        try:
            reply = await asyncio.wait_for(asyncio.shield(self._load_reply), timeout_s)
        except (ConnectionError, TimeoutError) as exc:
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
        if self.launch.gpu is not None and reply.device.get("kind") == "cuda":
            # Reported as the GPU's index among the daemon's, the numbering `gpus` and metrics use.
            reply = dataclasses.replace(reply, device={**reply.device, "index": self.launch.gpu})
        self.ready = reply
        device = reply.device
        skipped = device.get("skipped")
        extra: dict[str, object] = {"skipped_devices": skipped} if skipped else {}  # KIND_AUTO: why not a GPU
        if self.launch.model.cuda_graph_batch_sizes:  # asked for: say what was recorded, or why none
            off = f"off: not on a CUDA device ({device.get('kind')})"
            extra["cuda_graphs"] = list(reply.cuda_graphs) or off
            extra["cuda_graphs_ms"] = round(reply.cuda_graphs_ms, 1)
        log.info(
            "worker ready",
            **extra,
            worker=self.launch.label,
            pid=self.pid,
            kind=self.launch.kind,
            device=device.get("kind"),
            device_index=device.get("index"),
            device_name=device.get("name"),
            memory_fraction=device.get("memory_fraction"),
            load_ms=round(reply.load_ms, 1),
            warmup_ms=round(reply.warmup_ms, 1),
        )
        self.last_seen = loop.time()
        if self.heartbeat_timeout_s:
            self._tasks.append(asyncio.create_task(self._watch_heartbeat()))
        return reply

    async def _pump_output(self, stream: asyncio.StreamReader, name: str) -> None:
        """Every line a worker prints becomes a log event tagged with its model and pid."""
        level = log.info if name == "stdout" else log.warning

        def too_long() -> None:
            log.warning("worker output line too long; dropped", worker=self.launch.label, pid=self.pid)

        async for text in output_lines(stream, too_long):
            level(
                text,
                source=f"worker.{name}",
                worker=self.launch.label,
                model=self.launch.model.name,
                version=self.launch.model.version,
                pid=self.pid,
            )

    def _on_beat(self) -> None:
        """Heartbeats waiting on the beat channel: each says the worker process is still running."""
        try:
            while self._beats is not None:
                if not self._beats.recv(16):
                    self._close_beats()  # the worker's end is closed: it is gone, _on_closed follows
                    return
        except BlockingIOError:
            pass
        except OSError:
            self._close_beats()
            return
        self.last_seen = asyncio.get_running_loop().time()

    def _close_beats(self) -> None:
        if self._beats is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._beats.fileno())
            self._beats.close()
            self._beats = None

    def _on_message(self, msg: object) -> None:
        """Every message from the worker, handled as it arrives (in the socket's read callback)."""
        self.last_seen = asyncio.get_running_loop().time()
        if self._load_reply is not None:  # loading: the first other message is the answer to Init
            if not self._load_reply.done():
                self._load_reply.set_result(msg)
            self._load_reply = None
        elif isinstance(msg, p.NeedOutput):
            entry = self._inflight.get(msg.req_id)
            if entry is not None:
                self._grow_output(entry[1], msg.nbytes)
        elif isinstance(msg, p.MemorySnapshot):
            self.memory = msg.memory
            self._check_ceilings(msg.memory)
            log.debug("worker memory", worker=self.launch.label, pid=self.pid, **msg.memory)
        elif isinstance(msg, (p.InferDone, p.InferFailed)):
            entry = self._inflight.pop(msg.req_id, None)
            if entry is not None and not entry[0].done():
                entry[0].set_result(msg)

    def _on_closed(self, exc: Exception | None) -> None:
        self._close_beats()
        if self._load_reply is not None and not self._load_reply.done():
            self._load_reply.set_exception(ConnectionError("the worker closed its channel"))
        self._tasks.append(asyncio.create_task(self._after_close()))

    async def _after_close(self) -> None:
        """The channel is gone: wait for the process, fail the request in flight, report the death."""
        await self._wait_exit(None)
        inflight = list(self._inflight.values())
        self._inflight.clear()
        why = f" ({self.kill_reason})" if self.kill_reason else ""
        for pending, _ in inflight:
            if not pending.done():
                pending.set_exception(
                    WorkerDied(
                        f"model '{self.launch.model.name}' version {self.launch.model.version}: worker "
                        f"pid {self.pid} {self.exit_description}{why} while running the request"
                    )
                )
        if not self._stopping and self.ready is not None:
            log.error("worker died", worker=self.launch.label, pid=self.pid, exit=self.exit_description)
        self._release_regions()
        self.died.set()

    def _check_ceilings(self, memory: dict[str, int]) -> None:
        """Flag the worker for replacement once its memory passes a configured ceiling (MPS and CUDA caches
        grow when input shapes vary). A ceiling below the freshly loaded model's own footprint is reported
        once and then ignored, so a worker is never replaced in a loop."""
        limits = (
            (
                "device memory",
                self.launch.max_device_memory_bytes,
                memory.get("allocated_bytes", memory.get("current_allocated_bytes")),
            ),
            ("RSS", self.launch.max_rss_bytes, memory.get("rss_bytes")),
        )
        over = [
            (what, limit, used) for what, limit, used in limits if limit and used is not None and used > limit
        ]
        if not self._baseline_checked:
            self._baseline_checked = True
            if over:
                what, limit, used = over[0]
                log.warning(
                    "memory ceiling is below the loaded model's footprint; not recycling this worker",
                    worker=self.launch.label,
                    pid=self.pid,
                    measure=what,
                    ceiling=limit,
                    used=used,
                )
                self.launch = dataclasses.replace(
                    self.launch, max_device_memory_bytes=None, max_rss_bytes=None
                )
            return
        if over and not self.over_ceiling.is_set():
            what, limit, used = over[0]
            self.ceiling_reason = f"{what} {used} bytes above the ceiling of {limit}"
            self.over_ceiling.set()

    async def _watch_heartbeat(self) -> None:
        """A worker silent for longer than the heartbeat timeout is stopped or wedged: kill it."""
        loop = asyncio.get_running_loop()
        while not self.died.is_set():
            await asyncio.sleep(min(1.0, self.heartbeat_timeout_s / 4))
            silent = loop.time() - self.last_seen
            if silent > self.heartbeat_timeout_s and not self.died.is_set() and not self._stopping:
                self.kill_reason = f"no heartbeat for {silent:.1f} s"
                log.error("worker hung", worker=self.launch.label, pid=self.pid, reason=self.kill_reason)
                if self._proc is not None and self._proc.returncode is None:
                    with contextlib.suppress(ProcessLookupError):
                        self._proc.kill()
                return

    async def _wait_exit(self, timeout_s: float | None) -> None:
        if self._proc is None:
            return
        try:
            self.returncode = await asyncio.wait_for(self._proc.wait(), timeout_s)
        except TimeoutError:
            await self.kill()

    def _grow_output(self, slot: int, nbytes: int) -> None:
        region = self.slots[slot].grow_output(nbytes)
        assert self._transport is not None
        self._transport.write(encode(p.OutputRegion(region)))

    def _release_regions(self) -> None:
        for regions in self.slots:
            regions.release()

    async def _take_slot(self) -> int:
        while not self._free_slots:
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return self._free_slots.pop()

    def _give_slot(self, slot: int) -> None:
        self._free_slots.append(slot)
        self._slot_freed.set()

    async def infer_batch(
        self,
        tensors: Tensors[T_co],
        timings: PhaseTimes,
        waiting: Sequence[asyncio.Future[Any]] = (),
        deadline: float | None = None,
    ) -> T_co:
        """Run one execution: `tensors` writes its inputs straight into the slot's shared memory and reads
        its results out of it; `timings` gets the phases (the daemon's own writing and reading included).

        Takes one of the worker's slots for the execution; with both in use it waits for one to free up.
        Once every future in `waiting` is done (the callers went away) or `deadline` (time.monotonic(), the
        latest of the requests') has passed, an execution the worker has not started yet is skipped.
        """
        slot = await self._take_slot()
        kept = False  # the worker still uses the slot after this call ends: it is freed when it answers
        try:
            return await self._run_in_slot(slot, tensors, timings, waiting, deadline)
        except _Abandoned as abandoned:
            kept = True
            abandoned.pending.add_done_callback(lambda _: self._give_slot(slot))
            raise abandoned.cause from None
        finally:
            if not kept:
                self._give_slot(slot)

    async def _run_in_slot(
        self,
        slot: int,
        tensors: Tensors[T_co],
        timings: PhaseTimes,
        waiting: Sequence[asyncio.Future[Any]],
        deadline: float | None,
    ) -> T_co:
        model = self.launch.model
        if self.died.is_set() or self._stopping or self._transport is None:
            raise WorkerDied(f"model '{model.name}' version {model.version}: worker is not running")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        size = tensors.lay_out()
        regions = self.slots[slot]
        in_region = regions.input_for(size)
        buf = in_region.buf
        buf[0] = 0  # wanted (see `_watch`)
        tensors.write(buf)
        out = regions.output_region()
        wanted = tensors.outputs()
        write_ns = int((loop.time() - t0) * 1e9)
        req_id = next(self._req_ids)
        in_ref, out_ref = region_ref(in_region), region_ref(out)
        msg = p.Infer(req_id, tensors.refs, wanted, in_ref, out_ref, slot, time.monotonic_ns())
        pending: asyncio.Future[object] = loop.create_future()  # settled by the answer or the death
        self._inflight[req_id] = (pending, slot)
        self._transport.write(encode(msg))
        unwatch = _watch(buf, waiting, deadline, loop)
        try:
            reply = await self._wait_reply(req_id, pending)
        except BaseException as exc:
            if not pending.done():
                if buf[0] == 0:  # nobody will take the answer: the worker may skip it if not started
                    buf[0] = p.ABANDONED_CANCELLED
                raise _Abandoned(pending, exc) from None
            raise
        finally:
            unwatch()
        if isinstance(reply, p.InferFailed):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, p.InferDone) or reply.req_id != req_id:
            raise Internal(f"protocol error: unexpected reply {type(reply).__name__} from worker")
        if regions.output is None:  # released: the worker died right after answering
            raise WorkerDied(f"model '{model.name}' version {model.version}: worker is not running")
        regions.mapped_by_worker()
        out = regions.output_region()  # the worker may have asked for a larger one meanwhile
        r0 = loop.time()
        results = tensors.read(reply.outputs, out.buf)
        read_ns = int((loop.time() - r0) * 1e9)
        timings.worker_wait_ns = reply.waited_ns
        timings.compute_input_ns = write_ns + reply.compute_input_ns
        timings.compute_infer_ns = reply.compute_infer_ns
        timings.compute_output_ns = reply.compute_output_ns + read_ns
        return results

    async def _wait_reply(self, req_id: int, pending: asyncio.Future[object]) -> object:
        """The worker's answer; past the request timeout the worker counts as hung and is killed.

        The timeout counts from when the execution is the oldest in flight: one sent while another runs
        waits for that first. Shielded: a caller that is cancelled leaves the execution running, and its
        slot stays taken until the worker answers.
        """
        timeout = self.request_timeout_s
        if not timeout:
            return await asyncio.shield(pending)
        for older_id in [i for i in self._inflight if i < req_id]:
            entry = self._inflight.get(older_id)
            if entry is not None:
                with contextlib.suppress(Exception):
                    await asyncio.shield(entry[0])
        try:
            return await asyncio.wait_for(asyncio.shield(pending), timeout)
        except TimeoutError:
            self.kill_reason = f"no answer within request_timeout_s={timeout:g}"
            log.error("worker hung", worker=self.launch.label, pid=self.pid, reason=self.kill_reason)
            if self._proc is not None and self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            return await asyncio.shield(pending)

    async def stop(self, timeout_s: float) -> None:
        """Ask the worker to exit; TERM, then KILL if it does not."""
        self._stopping = True
        if self._proc is None or self.died.is_set():
            return
        if self._transport is not None:
            with contextlib.suppress(Exception):
                self._transport.write(encode(p.Shutdown()))
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
        if self._proc is not None:
            if self._proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    self._proc.kill()
            self.returncode = await self._proc.wait()
        self._close()

    def _close(self) -> None:
        if self._transport is not None:
            self._transport.close()
        self._close_beats()
        self._release_regions()


__all__ = ["WorkerLaunch", "WorkerProcess", "describe_exit"]
