"""Is a worker alive, and within its memory? Heartbeats arrive on a datagram socket of their own, a watchdog
calls a worker silent for longer than the heartbeat timeout hung, and the memory snapshots it sends are held
against the configured ceilings."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import structlog

from mpsd.daemon.supervise.worker.process import WorkerLaunch

log = structlog.get_logger("mpsd.daemon.worker")


class Liveness:
    """`hung(reason)` is called once the worker has been silent for longer than `timeout_s` (0: never)."""

    def __init__(self, launch: WorkerLaunch, timeout_s: float, hung: Callable[[str], None]) -> None:
        self.launch = launch
        self.timeout_s = timeout_s
        self.last_seen = 0.0  # loop time of the latest beat or message: the channel sets it too
        self.memory: dict[str, int] = {}
        self.over_ceiling = asyncio.Event()
        self.ceiling_reason = ""
        self.pid: int | None = None
        self._hung = hung
        self._ceilings = (launch.max_device_memory_bytes, launch.max_rss_bytes)
        self._baseline_checked = False
        self._beats: socket.socket | None = None
        self._off = False
        self._watchdog: asyncio.Task[None] | None = None
        # Longer silence allowed for now (a profile: stopping torch.profiler and exporting its trace hold the
        # worker's interpreter, heartbeat thread included, for seconds on a busy model); 0: just the timeout
        self.patience_s = 0.0

    @property
    def interval_s(self) -> float:
        """How often the worker should beat: often enough that a few lost beats do not look like a hang."""
        return max(0.1, min(1.0, self.timeout_s / 5)) if self.timeout_s else 1.0

    @property
    def snapshots_wanted(self) -> bool:
        """With a memory ceiling, the worker sends a snapshot after every request."""
        return bool(self.launch.max_device_memory_bytes or self.launch.max_rss_bytes)

    def listen(self, beats: socket.socket, pid: int | None) -> None:
        self.pid = pid
        beats.setblocking(False)
        self._beats = beats
        asyncio.get_running_loop().add_reader(beats.fileno(), self._on_beat)

    def _on_beat(self) -> None:
        """Heartbeats waiting on the beat channel: each says the worker process is still running."""
        try:
            while self._beats is not None:
                if not self._beats.recv(16):
                    self.close()  # the worker's end is closed: it is gone, the channel's close follows
                    return
        except BlockingIOError:
            pass
        except OSError:
            self.close()
            return
        self.last_seen = asyncio.get_running_loop().time()

    def close(self) -> None:
        """Stop listening for beats."""
        if self._beats is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._beats.fileno())
            self._beats.close()
            self._beats = None

    def watch(self, died: asyncio.Event) -> None:
        """The worker is ready: from now on, silence past the timeout makes it hung (until `died`)."""
        self.last_seen = asyncio.get_running_loop().time()
        if self.timeout_s:
            self._watchdog = asyncio.create_task(self._watch(died))

    def off(self) -> None:
        """The worker is being stopped: its silence is expected now."""
        self._off = True

    async def _watch(self, died: asyncio.Event) -> None:
        """A worker silent for longer than the heartbeat timeout is stopped or wedged."""
        loop = asyncio.get_running_loop()
        while not died.is_set():
            await asyncio.sleep(min(1.0, self.timeout_s / 4))
            silent = loop.time() - self.last_seen
            if self.too_silent(silent) and not died.is_set() and not self._off:
                self._hung(f"no heartbeat for {silent:.1f} s")
                return

    def too_silent(self, silent_s: float) -> bool:
        """Whether silence this long makes the worker hung (the heartbeat timeout, or the patience allowed
        for now if longer)."""
        return silent_s > max(self.timeout_s, self.patience_s)

    def snapshot(self, memory: dict[str, int]) -> None:
        """The worker's memory after a request (or after loading)."""
        self.memory = memory
        self._check_ceilings(memory)
        log.debug("worker memory", worker=self.launch.label, pid=self.pid, **memory)

    def _check_ceilings(self, memory: dict[str, int]) -> None:
        """Flag the worker for replacement once its memory passes a configured ceiling (MPS and CUDA caches
        grow when input shapes vary). A ceiling below the freshly loaded model's own footprint is reported
        once and then ignored, so a worker is never replaced in a loop."""
        max_device, max_rss = self._ceilings
        limits = (
            (
                "device memory",
                max_device,
                memory.get("allocated_bytes", memory.get("current_allocated_bytes")),
            ),
            ("RSS", max_rss, memory.get("rss_bytes")),
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
                self._ceilings = (None, None)
            return
        if over and not self.over_ceiling.is_set():
            what, limit, used = over[0]
            self.ceiling_reason = f"{what} {used} bytes above the ceiling of {limit}"
            self.over_ceiling.set()
