"""The CPUs a benchmark may use and pin to, and the CPU's name, on Linux and on macOS.

Linux has CPU affinity (`os.sched_getaffinity`/`sched_setaffinity`) and /proc/cpuinfo; macOS has neither,
so there every CPU is usable, nothing is pinned, and the name comes from sysctl. Standard library only:
the load generator's parent imports it.
"""

from __future__ import annotations

import contextlib
import os
import platform
import subprocess
from collections.abc import Callable, Collection, Iterable
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def can_pin() -> bool:
    """Whether processes can be confined to CPUs here (Linux; macOS has no affinity call)."""
    return hasattr(os, "sched_setaffinity")


def usable_cpus() -> list[int]:
    """The CPUs this process may run on: its affinity where there is one, otherwise all of them."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return list(range(os.cpu_count() or 1))


def affinity(pid: int) -> set[int] | None:
    """The CPUs process `pid` may run on; None where the system has no affinity."""
    try:
        return set(os.sched_getaffinity(pid))
    except AttributeError:
        return None


def pinned_to(cpus: Collection[int] | None) -> Callable[[], None] | None:
    """A `preexec_fn` that confines the new process to `cpus` before it runs anything (its children
    inherit the affinity); None for no pinning, or where the system cannot pin."""
    if not cpus or not can_pin():
        return None
    chosen = set(cpus)
    return lambda: os.sched_setaffinity(0, chosen)


def pin_threads(pids: Iterable[int], cpus: Collection[int]) -> None:
    """Confine every thread of these processes to `cpus` (Linux; nothing elsewhere). Threads started later
    inherit the mask of the thread that starts them, so a process pinned once stays pinned."""
    if not can_pin():
        return
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), set(cpus))


def cpu_name() -> str:
    """The CPU's model name: /proc/cpuinfo on Linux, sysctl on macOS, else what `platform` knows."""
    with contextlib.suppress(OSError):
        for line in CPUINFO.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        brand = subprocess.run(
            ["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
        if brand:
            return brand
    return platform.processor() or platform.machine()
