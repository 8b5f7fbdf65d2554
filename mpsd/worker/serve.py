"""The worker's serving loop: requests from the daemon, run from shared memory to shared memory.

On a device with completion events (CUDA) the loop keeps up to two executions on the device: while one
runs it watches the socket, and the next execution that arrives is launched behind it at once, its
outputs' copies to the host queued too. The device then goes from one to the next without waiting for the
host to answer the first and launch the second. Answers still leave in order, one per execution.
Elsewhere executions run one at a time.
"""

from __future__ import annotations

import socket
import time
from collections import deque
from typing import TYPE_CHECKING

from mpsd.errors import ErrorCode, MpsdError
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import ConnectionClosed, FrameReader, send_blocking
from mpsd.ipc.shm import Region
from mpsd.worker.inbox import Inbox
from mpsd.worker.regions import Arenas, RegionCache

if TYPE_CHECKING:
    from mpsd.worker.inference import Launch, Runner
    from mpsd.worker.profiling import Profiler


# Each seat's regions, by role name in the region cache.
_INPUT_ROLES = tuple(f"input{seat}" for seat in range(p.SEATS))
_OUTPUT_ROLES = tuple(f"output{seat}" for seat in range(p.SEATS))


def _waited_ns(msg: p.Infer) -> int:
    """From the daemon's sending of the execution until now (0 when it did not say when it sent it)."""
    return max(0, time.monotonic_ns() - msg.sent_ns) if msg.sent_ns else 0


class Serving:
    """Answers requests until the daemon says Shutdown or goes away (`run`).

    Runs under inference mode, entered once rather than per request. Between requests, and at least every
    fifth of the snapshot interval while idle, memory counters are sent when they are due.
    """

    def __init__(
        self,
        sock: socket.socket,
        runner: Runner,
        snapshot_interval_s: float = 5.0,
        after_request: bool = False,
        arenas: Arenas | None = None,
        inbox: Inbox | None = None,
    ) -> None:
        from mpsd.worker.host import host_pinner
        from mpsd.worker.profiling import Profiler

        self.sock = sock
        self.runner = runner
        self.snapshot_interval_s = snapshot_interval_s
        self.after_request = after_request
        self.regions = RegionCache(host_pinner(runner.device))
        self.arenas = arenas if arenas is not None else Arenas(())
        # Read through the inbox: a python model's calls to other models get their answers as they come.
        self.inbox = inbox if inbox is not None else Inbox(sock, FrameReader(sock, snapshot_interval_s / 5))
        self.early: deque[object] = self.inbox.early
        self.last_snapshot = 0.0
        self.profiler: Profiler = Profiler(runner.device, lambda m: send_blocking(sock, m))
        self.running: tuple[p.Infer, Launch] | None = None  # launched, not answered yet

    def run(self) -> None:
        import torch

        with torch.inference_mode():
            try:
                while self._step():
                    pass
            except ConnectionClosed:
                return

    def _step(self) -> bool:
        """Handle the next message (or the end of the execution on the device); False: stop serving."""
        self._snapshot_if_due()
        if self.early:
            msg = self.early.popleft()
        elif self.running is not None:
            msg = self._next_or_done(self.running[1])
        else:
            msg = self.inbox.recv()
        if msg is None:  # the execution on the device is done (or, idle, the reader's timeout)
            self._finish_running()
        elif isinstance(msg, p.Infer):
            self._execute(msg)
        else:
            self._finish_running()  # anything else waits for the execution on the device
            if isinstance(msg, p.ForgetArena):
                self.arenas.forget(msg.arena_id)
            elif isinstance(msg, p.StartProfile):
                self.profiler.start(msg)
            elif isinstance(msg, p.StopProfile):
                self.profiler.stop(msg.profile_id)
            elif isinstance(msg, p.Shutdown):
                self.profiler.stop(self.profiler.profile_id)
                return False
        return True

    def _snapshot_if_due(self) -> None:
        from mpsd.worker.device import memory_counters

        if time.monotonic() - self.last_snapshot >= self.snapshot_interval_s:
            # Counters are read on this (the device) thread, between requests, never during one.
            send_blocking(self.sock, p.MemorySnapshot(memory_counters(self.runner.device)))
            self.last_snapshot = time.monotonic()

    def _execute(self, msg: p.Infer) -> None:
        """Run one execution: launched behind the one on the device where executions overlap (which is then
        answered first), else from start to answer."""
        launch: Launch | None = None
        try:
            if self.runner.overlaps:
                launch = self._launch(msg)
            else:
                self._done(msg, self._infer(msg))
                return
        except ConnectionClosed:
            raise
        except Exception as exc:
            failure, oom = _failure(msg, exc)
            self._finish_running()
            self._fail(msg, failure, oom)
            return
        self._finish_running()
        self.running = (msg, launch)

    def _finish_running(self) -> None:
        """Answer the execution on the device, if there is one, once its work is done."""
        if self.running is None:
            return
        msg, launch = self.running
        self.running = None
        try:
            done = self._answer(msg, launch)
        except ConnectionClosed:
            raise
        except Exception as exc:
            failure, oom = _failure(msg, exc)
        else:
            self._done(msg, done)
            return
        del launch  # its tensors, before any release of cached memory
        self._fail(msg, failure, oom)

    # ---- one execution ---------------------------------------------------------------------------

    def _launch(self, msg: p.Infer) -> Launch:
        """Queue one execution's work on the device (on the CPU: run it), from its seat's input region."""
        waited_ns = _waited_ns(msg)
        inputs = self._claim(msg)
        self.inbox.req_id = msg.req_id  # the model's calls are made from this execution
        self.inbox.trace = msg.trace  # and are traced under it when it is
        views = self.regions.views(_INPUT_ROLES[msg.seat])
        if msg.sequence:  # a sequence model's rows: the slots whose implicit state they take and give back
            from mpsd.worker.sequence_state import StateKeeper

            backend = self.runner.backend
            if isinstance(backend, StateKeeper):
                backend.rows = msg.sequence
        launch = self.runner.launch(inputs, msg.inputs, views, msg.pieces, self.arenas, msg.parameters)
        launch.waited_ns = waited_ns
        if self.runner.overlaps:
            self.runner.copy_out(launch, msg.outputs)
        return launch

    def _claim(self, msg: p.Infer) -> Region:
        """The execution's input region, marked started; an execution nobody waits for any more (every
        caller cancelled or past its deadline) fails instead."""
        inputs = self.regions.get(_INPUT_ROLES[msg.seat], msg.input_region)
        abandoned = inputs.buf[0]  # the seat's control block: nobody waits for this execution any more
        if abandoned == p.ABANDONED_EXPIRED:
            raise MpsdError(
                "every request of the batch was past its deadline before it ran", ErrorCode.DEADLINE_EXCEEDED
            )
        if abandoned:
            raise MpsdError("every request of the batch was cancelled before it ran", ErrorCode.CANCELLED)
        inputs.buf[0] = p.STARTED
        return inputs

    def _answer(self, msg: p.Infer, launch: Launch) -> p.InferDone:
        """Wait for a launched execution and write its outputs to its seat's output region.

        Messages that arrive while it waits for a larger output region (the daemon's next request) go to
        `early`, to be handled after it.
        """
        from mpsd.worker.inference import host_nbytes, write_outputs

        runner = self.runner
        outputs, in_ns, infer_ns, device_ns = runner.finish(launch)
        t0 = time.perf_counter_ns()
        tensors = launch.host if launch.host is not None else runner.prepare_outputs(outputs, msg.outputs)
        del outputs
        out_ref = self._output_region(msg, msg.output_region, host_nbytes(tensors))
        refs = write_outputs(self.regions.get(_OUTPUT_ROLES[msg.seat], out_ref), msg.outputs, tensors)
        output_ns = time.perf_counter_ns() - t0
        return p.InferDone(msg.req_id, refs, in_ns, infer_ns, output_ns, launch.waited_ns, device_ns)

    def _infer(self, msg: p.Infer) -> p.InferDone:
        """Run one request from shared memory to shared memory (the regions of its seat), nothing else on
        the device meanwhile."""
        if self.runner.spec.decoupled:
            waited_ns = _waited_ns(msg)
            inputs = self._claim(msg)
            self.inbox.req_id = msg.req_id
            self.inbox.trace = msg.trace
            return self._stream(msg, inputs, waited_ns)
        return self._answer(msg, self._launch(msg))

    def _next_or_done(self, launch: Launch) -> object | None:
        """While a launched execution runs: the next message, as soon as one is here, or None once the
        execution is done (whichever comes first). The worker's thread waits for the device here either
        way (CUDA's own wait spins too); polling the socket alongside lets the next execution be queued
        before the device runs dry."""
        done = launch.done
        assert done is not None
        while not done.query():
            message = self.inbox.poll()
            if message is not None:
                return message
        return None

    def _output_region(self, msg: p.Infer, current: p.RegionRef, needed: int) -> p.RegionRef:
        """The seat's output region, asking the daemon for a larger one when `needed` bytes do not fit."""
        if needed <= current.size:
            return current
        send_blocking(self.sock, p.NeedOutput(msg.req_id, needed))
        while not isinstance(reply := self.inbox.recv_wait(), p.OutputRegion):
            self.early.append(reply)
        return reply.region

    def _stream(self, msg: p.Infer, inputs: Region, waited_ns: int) -> p.InferDone:
        """A decoupled model's request: each response goes to the daemon as a StreamPart through the seat's
        output region, and the model is resumed only once the daemon acknowledges it (so a slow client
        holds the model back); a `stop` in the acknowledgement closes the model's generator. The InferDone
        at the end carries no outputs: it is the final flag."""
        from mpsd.worker.inference import host_nbytes, write_outputs

        t0 = time.perf_counter_ns()
        out_ref = msg.output_region
        views = self.regions.views(_INPUT_ROLES[msg.seat])
        parts = self.runner.compute_stream(inputs, msg.inputs, views, msg.pieces, self.arenas, msg.parameters)
        index = 0
        try:
            for outputs in parts:
                tensors = self.runner.prepare_outputs(outputs, msg.outputs)
                del outputs
                out_ref = self._output_region(msg, out_ref, host_nbytes(tensors))
                refs = write_outputs(self.regions.get(_OUTPUT_ROLES[msg.seat], out_ref), msg.outputs, tensors)
                send_blocking(self.sock, p.StreamPart(msg.req_id, index, refs))
                while not (
                    isinstance(ack := self.inbox.recv_wait(), p.StreamAck) and ack.req_id == msg.req_id
                ):
                    self.early.append(ack)
                index += 1
                if ack.stop:
                    raise MpsdError(f"the stream was stopped after {index} responses", ErrorCode.CANCELLED)
        finally:
            parts.close()  # the model's generator: its `finally` runs now
        return p.InferDone(msg.req_id, (), 0, time.perf_counter_ns() - t0, 0, waited_ns, None)

    def _done(self, msg: p.Infer, done: p.InferDone) -> None:
        if msg.trace:
            from mpsd.worker.tracing import with_span

            done = with_span(msg, done)
        send_blocking(self.sock, done)
        if self.after_request:
            self.last_snapshot = 0.0
        self.profiler.executed(msg.requests)

    def _fail(self, msg: p.Infer, failure: p.InferFailed, oom: bool) -> None:
        from mpsd.worker.device import release_cached_memory

        if oom:  # outside the except block, so the traceback no longer pins the request's tensors
            release_cached_memory(self.runner.device)
            self.last_snapshot = 0.0
        send_blocking(self.sock, failure)
        self.profiler.executed(msg.requests)


def _failure(msg: p.Infer, exc: Exception) -> tuple[p.InferFailed, bool]:
    """The answer for an execution that raised, and whether the device ran out of memory."""
    from mpsd.worker.device import is_out_of_memory

    if isinstance(exc, MpsdError):
        return p.InferFailed(msg.req_id, exc.code.value, exc.message), False
    oom = is_out_of_memory(exc)
    code = ErrorCode.RESOURCE_EXHAUSTED if oom else ErrorCode.INTERNAL
    return p.InferFailed(msg.req_id, code.value, f"{type(exc).__name__}: {exc}"), oom
