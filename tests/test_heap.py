"""The heap's settings (mpsd/ipc/heap.py), each checked in a fresh process: large buffers stay in the heap,
seen with glibc's own counters; the collector, once settled, scans neither what start-up made nor young
objects every 700 allocations, and still collects a cycle made since."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from mpsd.ipc.heap import YOUNG_THRESHOLD

glibc_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")

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


@glibc_only
def test_a_large_buffer_comes_from_the_heap_once_the_thresholds_are_fixed() -> None:
    assert mmapped_blocks("default") == ("False", 1)  # glibc's default: its own mmap
    assert mmapped_blocks("tuned") == ("True", 0)


@glibc_only
def test_explicit_malloc_settings_win() -> None:
    assert mmapped_blocks("tuned", {"MALLOC_MMAP_THRESHOLD_": "131072"}) == ("False", 1)


# In a fresh process: start-up makes 1000 cycles of two objects that it keeps, then settles the collector;
# a cycle made since is dropped. Prints what was frozen, the young threshold, what a full collection then
# found, and how many objects the collector's generations still hold.
COLLECTOR = """
import gc
from mpsd.ipc.heap import settle_collector
class Node:
    pass
def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a
kept = [cycle() for _ in range(1000)]
frozen = settle_collector()
dropped = cycle()
del dropped
print(frozen, gc.get_threshold()[0], gc.collect(), len(gc.get_objects()))
"""


def test_a_settled_collector_leaves_what_start_up_made_out_of_its_scans() -> None:
    out = subprocess.run([sys.executable, "-c", COLLECTOR], capture_output=True, text=True, check=True)
    frozen, young, found, scanned = map(int, out.stdout.split())
    assert frozen > 2000  # the kept cycles among them
    assert scanned < frozen  # a full collection no longer walks them
    assert young == YOUNG_THRESHOLD
    assert found == 2  # the cycle dropped after start-up is still collected
