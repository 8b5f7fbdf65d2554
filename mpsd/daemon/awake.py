"""On macOS, keep the machine from idle sleep while the daemon serves.

A Mac that nobody uses goes to sleep after a while, and a sleeping Mac answers nothing. `caffeinate -i`
holds an assertion against idle system sleep (PreventUserIdleSystemSleep, listed by `pmset -g
assertions`) for as long as it runs, and `-w <pid>` ends it when that process ends, so a daemon that dies
does not leave the Mac awake for good. The daemon ends it itself at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil

import structlog

from mpsd import osfacts

log = structlog.get_logger("mpsd.daemon")

STOP_TIMEOUT_S = 5.0


class StayAwake:
    """A `caffeinate -i -w <daemon pid>` child while the daemon serves, where the system idle-sleeps."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        if not self.enabled or not osfacts.current().idle_sleeps:
            return
        program = shutil.which("caffeinate")
        if program is None:
            log.warning("caffeinate not found: the Mac may idle-sleep while the daemon serves")
            return
        argv = [program, "-i", "-w", str(os.getpid())]
        try:
            self._proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )
        except OSError as exc:
            log.warning("could not keep the Mac from idle sleep", command=argv, reason=str(exc))
            return
        log.info("keeping the Mac from idle sleep while serving", command=argv, pid=self._proc.pid)

    async def stop(self) -> None:
        """End the assertion: TERM, then KILL if it lingers; always reaped."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S)
        except asyncio.TimeoutError:  # 3.10: not yet the builtin TimeoutError
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
