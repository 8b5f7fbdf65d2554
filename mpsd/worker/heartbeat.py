"""Heartbeats to the daemon from a thread of their own, so a stopped (SIGSTOP) or wedged process is seen.

They go on a datagram socket of their own, not the request channel: the main thread is the only writer of
that one and sends without a lock. The thread touches no device state, so it does not break the one-thread
rule for MPS.

A full socket means the daemon has not read the last beats yet, which is no reason to stop: Linux answers
it with EAGAIN, macOS with ENOBUFS (`osfacts.dgram_full_errnos`). Any other error (the daemon is gone)
ends the thread.
"""

from __future__ import annotations

import socket
import threading
import time

from mpsd import osfacts

BEAT = b"\x01"


def start_heartbeat(beats: socket.socket, interval_s: float) -> threading.Thread:
    full = osfacts.current().dgram_full_errnos

    def _loop() -> None:
        while True:
            time.sleep(interval_s)
            try:
                beats.send(BEAT, socket.MSG_DONTWAIT)
            except OSError as exc:
                if exc.errno in full:
                    continue  # the daemon has not read the last ones: it knows we are alive
                return

    thread = threading.Thread(target=_loop, name="mpsd-heartbeat", daemon=True)
    thread.start()
    return thread
