"""Large buffers stay in the heap: glibc's malloc thresholds fixed at their ceilings in every mpsd process.

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
import os
import sys

MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's ceiling for its dynamic threshold on 64-bit systems
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # what glibc sets beside it when it raises the threshold
_M_TRIM_THRESHOLD = -1  # mallopt parameters, from glibc's malloc.h
_M_MMAP_THRESHOLD = -3
_OVERRIDES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


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
