"""Heartbeats to the daemon from a thread of their own, so a stopped (SIGSTOP) or wedged process is seen.

The thread touches no device state, so it does not break the one-thread rule for MPS.
"""

from __future__ import annotations

import socket
import threading
import time

from mpsd.ipc.framing import send_blocking
from mpsd.ipc.protocol import Heartbeat


def start_heartbeat(sock: socket.socket, interval_s: float) -> threading.Thread:
    def _loop() -> None:
        while True:
            time.sleep(interval_s)
            try:
                send_blocking(sock, Heartbeat())
            except OSError:
                return

    thread = threading.Thread(target=_loop, name="mpsd-heartbeat", daemon=True)
    thread.start()
    return thread
