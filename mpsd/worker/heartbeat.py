"""Heartbeats to the daemon from a thread of their own, so a stopped (SIGSTOP) or wedged process is seen.

They go on a datagram socket of their own, not the request channel: the main thread is the only writer of
that one and sends without a lock. The thread touches no device state, so it does not break the one-thread
rule for MPS.
"""

from __future__ import annotations

import socket
import threading
import time

BEAT = b"\x01"


def start_heartbeat(beats: socket.socket, interval_s: float) -> threading.Thread:
    def _loop() -> None:
        while True:
            time.sleep(interval_s)
            try:
                beats.send(BEAT, socket.MSG_DONTWAIT)
            except BlockingIOError:
                continue  # the daemon has not read the last ones: it knows we are alive
            except OSError:
                return

    thread = threading.Thread(target=_loop, name="mpsd-heartbeat", daemon=True)
    thread.start()
    return thread
