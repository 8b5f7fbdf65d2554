"""The heap of every mpsd process: large buffers stay in it (glibc's malloc thresholds fixed at their
ceilings), and the cyclic garbage collector is set for a process that serves for hours (`settle_collector`).

By default glibc serves an allocation of 128 KiB or more with its own mmap, and unmaps it when freed; it
raises that threshold as such blocks are freed, and returns freed memory at the top of the heap to the
system past a trim threshold. A server that allocates and frees a request's and a response's bytes on
every call can keep landing on the mmap side: each 600 KB request then faulted in and zeroed fresh pages.
On the 2-core machine that made a 600 KB identity request 1.6-1.9 ms instead of 0.9 ms, depending on the
order of allocations in the request path (bench/results/malloc-thresholds-cpu.md). Fixing the thresholds
where glibc's own adjustment would end (32 MiB, trim at twice that) keeps such buffers in the heap for
reuse; the heap keeps up to the trim threshold of freed memory.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys

MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling for its dynamic threshold on 64-bit systems
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets beside it when it raises the threshold
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_OVERRIDES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
YOUNG_THRESHOLD = 10_000  # allocations between scans of the young objects; CPython's default is 700


def keep_large_buffers_in_heap() -> bool:
    """Fix the thresholds (glibc on Linux only); True when set. Explicit MALLOC_* settings win."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in _OVERRIDES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def settle_collector() -> int:
    """Once a process has started (the daemon's first models loaded, a front listening, a worker's model
    loaded and warm): collect what it no longer holds, freeze the rest out of the collector's scans, and
    scan the young objects every YOUNG_THRESHOLD allocations. Returns how many objects are frozen.

    Reference counting frees the tens of objects each request makes; the cyclic collector still counts
    them, scans the young objects every 700 allocations and every hundredth time the whole heap. With
    ResNet-50 at 256 clients on the H200 that was 8% of the daemon's CPU, and each full collection held its
    event loop for up to 54 ms (the worker's, with torch's objects, 67 ms) while every request in flight
    waited. Frozen (`gc.freeze`), what start-up made (modules, configs, the model) is never scanned again;
    by YOUNG_THRESHOLD allocations, most of a request's objects are freed already. Cycles among the frozen
    objects are never collected: they live as long as the process, but for a model the daemon later
    unloads, whose few cycles stay."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
    return gc.get_freeze_count()
