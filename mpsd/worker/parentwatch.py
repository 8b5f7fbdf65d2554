"""Exit when the daemon dies. macOS has no PDEATHSIG, so the worker polls its parent pid."""

from __future__ import annotations

import os
import threading
import time

from mpsd.ipc.protocol import EXIT_PARENT_GONE


def watch_parent(parent_pid: int, interval_s: float = 0.5) -> threading.Thread:
    """Start a daemon thread that hard-exits this process once `parent_pid` is no longer our parent.

    The thread touches no device state, so it does not break the one-thread rule for MPS.
    """

    def _loop() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(EXIT_PARENT_GONE)
            time.sleep(interval_s)

    thread = threading.Thread(target=_loop, name="mpsd-parent-watch", daemon=True)
    thread.start()
    return thread
