"""The daemon's handle on one worker: its process and its liveness behind the one interface an instance uses
(start, stop, kill, died, over_ceiling), and the execution channel an instance hands the data plane once the
worker is ready."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import structlog

from mpsd.daemon.dataplane.calls import CallHandler
from mpsd.daemon.dataplane.channel import Channel
from mpsd.daemon.supervise.worker.liveness import Liveness
from mpsd.daemon.supervise.worker.process import Process, WorkerLaunch, describe_exit
from mpsd.errors import LoadError
from mpsd.ipc import protocol as p

log = structlog.get_logger("mpsd.daemon.worker")
# How long a worker that closed its connection while loading has to exit before it is killed.
EXITING_S = 2.0


class WorkerProcess:
    """One worker, from exec to reaping; `died` is set once it has ended and its requests have failed."""

    def __init__(
        self,
        launch: WorkerLaunch,
        request_timeout_s: float = 0.0,
        heartbeat_timeout_s: float = 10.0,
        calls: CallHandler | None = None,
    ) -> None:
        self.launch = launch
        self.kill_reason = ""
        self.ready: p.Ready | None = None
        self.died = asyncio.Event()
        self.process = Process(launch)
        self.liveness = Liveness(launch, heartbeat_timeout_s, self._hung)
        self.channel = Channel(
            launch.model, self.liveness, request_timeout_s, self._hung, launch.label, calls=calls
        )
        self.over_ceiling = self.liveness.over_ceiling
        self._stopping = False
        self._after: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    @property
    def exit_description(self) -> str:
        return describe_exit(self.process.returncode)

    @property
    def memory(self) -> dict[str, int]:
        """The worker's latest memory snapshot."""
        return self.liveness.memory

    @property
    def ceiling_reason(self) -> str:
        return self.liveness.ceiling_reason

    async def start(self, timeout_s: float) -> p.Ready:
        """Spawn (exec, never fork), send Init, wait for Ready; raises LoadError with the reason."""
        sock, beats = await self.process.spawn()
        self.liveness.listen(beats, self.pid)
        self.channel.pid = self.pid
        load_reply = self.channel.expect_reply()
        # A start cancelled while it waits (the daemon stopping) leaves the reply to fail when the channel
        # closes: marked retrieved here, so that is not logged as an error nobody read.
        load_reply.add_done_callback(lambda f: f.cancelled() or f.exception())
        await self.channel.connect(sock, self._on_closed)
        log.info("worker started", worker=self.launch.label, pid=self.pid, kind=self.launch.kind)
        self.process.pump_output()
        self._send_init()
        reply = await self._await_ready(load_reply, timeout_s)
        self.ready = reply
        self.channel.overlaps = reply.overlaps
        if not reply.calls_models:  # no execution of this model can call another: its router stays out
            self.channel.calls.handler = None
        self._log_ready(reply)
        self.liveness.watch(self.died)
        return reply

    def _send_init(self) -> None:
        """What the worker loads and how; the fronts' arenas it inherited are mapped on this side first."""
        init = p.Init(
            self.launch.model,
            self.launch.instance,
            self.launch.kind,
            self.launch.memory_fraction,
            heartbeat_interval_s=self.liveness.interval_s,
            snapshot_after_request=self.liveness.snapshots_wanted,
            accelerator=self.launch.accelerator,
            arenas=self.process.arenas,
        )
        self.channel.arenas.map(self.process.arenas)
        self.channel.send(init)

    async def _await_ready(self, load_reply: asyncio.Future[object], timeout_s: float) -> p.Ready:
        """The worker's Ready, its CUDA device numbered as the daemon numbers its GPUs; LoadError when the
        load failed (the worker then exits by itself), or the worker ended, did not answer in time or
        answered something else (it is then killed)."""
        try:
            reply = await asyncio.wait_for(asyncio.shield(load_reply), timeout_s)
        except (ConnectionError, TimeoutError) as exc:
            timed_out = isinstance(exc, TimeoutError)
            # A worker that closed its end is exiting: reaped as it ends, its own exit status is the
            # reason. Killed at once, the kill's own poll could reap it first, and asyncio's watcher would
            # then report 255 for it.
            if timed_out or not await self.process.wait_exit(EXITING_S):
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
        return reply

    def _log_ready(self, reply: p.Ready) -> None:
        """Log where the worker runs and what loading it took; warn when Triton's mps accelerator was asked
        for and the worker is not on MPS."""
        device = reply.device
        skipped = device.get("skipped")
        extra: dict[str, object] = {"skipped_devices": skipped} if skipped else {}  # KIND_AUTO: why not a GPU
        if self.launch.model.cuda_graph_batch_sizes:  # asked for: say what was recorded, or why none
            off = f"off: not on a CUDA device ({device.get('kind')})"
            extra["cuda_graphs"] = list(reply.cuda_graphs) or off
            extra["cuda_graphs_ms"] = round(reply.cuda_graphs_ms, 1)
        if reply.compile_ms is not None:  # optimization.compile: the compiling warm-up's time
            extra["compile_ms"] = round(reply.compile_ms, 1)
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
            frozen_objects=reply.frozen_objects,
        )
        if self.launch.accelerator == "mps" and device.get("kind") != "mps":
            # Triton's mps accelerator, off a Mac with a usable MPS: served anyway, and said why.
            reason = skipped.get("mps", "") if isinstance(skipped, dict) else ""
            log.warning(
                "mps accelerator not used",
                worker=self.launch.label,
                pid=self.pid,
                device=device.get("kind"),
                reason=reason or "unknown",
            )

    def _hung(self, reason: str) -> None:
        """No heartbeat, or no answer in time: the worker is stopped or wedged; kill it."""
        self.kill_reason = reason
        log.error("worker hung", worker=self.launch.label, pid=self.pid, reason=reason)
        self.process.kill_now()

    def _on_closed(self) -> None:
        self.liveness.close()
        self._after = asyncio.create_task(self._after_close())

    async def _after_close(self) -> None:
        """The channel is gone: wait for the process, fail the requests in flight, report the death."""
        await self._wait_exit(None)
        why = f" ({self.kill_reason})" if self.kill_reason else ""
        model = self.launch.model
        self.channel.fail(
            f"model '{model.name}' version {model.version}: worker "
            f"pid {self.pid} {self.exit_description}{why} while running the request"
        )
        if not self._stopping and self.ready is not None:
            log.error("worker died", worker=self.launch.label, pid=self.pid, exit=self.exit_description)
        self.channel.release()
        self.died.set()

    async def _wait_exit(self, timeout_s: float | None) -> None:
        if not await self.process.wait_exit(timeout_s):
            await self.kill()

    def _stop_taking_work(self) -> None:
        self._stopping = True
        self.channel.refusing = True
        self.liveness.off()

    async def stop(self, timeout_s: float) -> None:
        """Ask the worker to exit; TERM, then KILL if it does not."""
        self._stop_taking_work()
        if not self.process.started or self.died.is_set():
            return
        if self.channel.connected:
            with contextlib.suppress(Exception):
                self.channel.send(p.Shutdown())
        await self.process.stop(self.died, timeout_s)
        self._close()
        log.info("worker stopped", worker=self.launch.label, pid=self.pid, exit=self.exit_description)

    async def kill(self) -> None:
        self._stop_taking_work()
        await self.process.kill()
        self._close()

    def _close(self) -> None:
        self.channel.close()
        self.liveness.close()
