"""Large buffers stay in the heap (mpsd/ipc/heap.py), checked in fresh processes with glibc's own counters."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")

# In a fresh process, allocate 16 MiB (above glibc's initial 128 KiB mmap threshold, below the fixed one)
# and print how many blocks glibc's mallinfo2 counts as mmapped.
PROBE = """
import ctypes, sys
from mpsd.ipc.heap import keep_large_buffers_in_heap
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
                 "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = Info
tuned = keep_large_buffers_in_heap() if sys.argv[1] == "tuned" else False
before = mallinfo2().hblks
block = bytearray(16 * 1024 * 1024)
print(tuned, mallinfo2().hblks - before)
"""


def mmapped_blocks(mode: str, env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, **(env or {})},
    ).stdout.split()
    return out[0], int(out[1])


def test_a_large_buffer_comes_from_the_heap_once_the_thresholds_are_fixed() -> None:
    assert mmapped_blocks("default") == ("False", 1)  # glibc's default: its own mmap
    assert mmapped_blocks("tuned") == ("True", 0)


def test_explicit_malloc_settings_win() -> None:
    assert mmapped_blocks("tuned", {"MALLOC_MMAP_THRESHOLD_": "131072"}) == ("False", 1)
