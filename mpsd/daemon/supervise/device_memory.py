"""How much memory each device has, found without importing torch (the daemon never does).

System RAM comes from the kernel. A CUDA GPU's total comes from `nvidia-smi` when the driver ships it, and
otherwise from the first worker on that GPU (its memory snapshots carry `total_bytes`); an Apple GPU's
usable size (Metal's recommended working set, `torch.mps.recommended_max_memory()`) only ever comes from a
worker's `recommended_max_bytes`. A device whose size is not known yet has no budget yet.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Mapping
from functools import cache

import structlog

log = structlog.get_logger("mpsd.daemon.supervise.device_memory")

# Which counter of a worker's memory snapshot says how large its device is.
SIZE_COUNTERS = {"cuda": "total_bytes", "mps": "recommended_max_bytes"}


def system_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@cache
def nvidia_smi_sizes() -> dict[int, int]:
    """Each GPU's total memory by index, as the driver lists them (empty where nvidia-smi is missing)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return {}
    try:
        out = subprocess.run(
            [tool, "--query-gpu=index,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("could not read GPU memory sizes", error=str(exc))
        return {}
    sizes = {}
    for line in out.splitlines():
        index, _, mib = line.partition(",")
        if index.strip().isdigit() and mib.strip().isdigit():
            sizes[int(index)] = int(mib) * 1024 * 1024
    return sizes


class DeviceSizes:
    """Device sizes by device key (`cpu`, `cuda:N`, `mps`), learning GPU sizes from workers' snapshots."""

    def __init__(self, ram_bytes: Callable[[], int] = system_memory_bytes) -> None:
        self._learned: dict[str, int] = {}
        self._ram_bytes = ram_bytes

    def learn(self, device_key: str, snapshot: Mapping[str, int]) -> None:
        counter = SIZE_COUNTERS.get(device_key.partition(":")[0])
        size = snapshot.get(counter) if counter else None
        if size:
            self._learned[device_key] = int(size)

    def size(self, device_key: str) -> int | None:
        if device_key == "cpu":
            return self._ram_bytes()
        if device_key in self._learned:
            return self._learned[device_key]
        kind, _, index = device_key.partition(":")
        if kind == "cuda" and index.isdigit():
            return nvidia_smi_sizes().get(int(index))
        return None
