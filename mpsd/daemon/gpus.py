"""How many CUDA GPUs the daemon may use, found without importing torch.

Placement spreads an unpinned KIND_GPU or KIND_AUTO group over every GPU (Triton's rule), so the count
must be known before any worker starts. Importing torch to ask CUDA would cost the daemon seconds of
start-up and hundreds of MB; the NVIDIA driver lists its GPUs under /proc instead, one entry per GPU the
process can reach (a container sees only those given to it). `CUDA_VISIBLE_DEVICES` narrows that list the
way CUDA does. Where the driver's list is missing (macOS, no NVIDIA driver, a container without /proc/driver),
the count is 0 and an unpinned group keeps one set of instances on the first GPU the worker finds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import cache
from pathlib import Path

from .placement import ENV_CUDA_VISIBLE

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def _visible_entries(value: str) -> int:
    """How many devices a `CUDA_VISIBLE_DEVICES` value names: CUDA stops at the first invalid entry, and an
    index below zero is one ("-1" is the usual way to hide every GPU)."""
    count = 0
    for raw in value.split(","):
        entry = raw.strip()
        if not entry or (entry.lstrip("-").isdigit() and int(entry) < 0):
            break
        count += 1
    return count


def cuda_gpu_count(env: Mapping[str, str], driver_list: Path = NVIDIA_GPUS) -> int:
    """The GPUs a process started with `env` may use: the driver's GPUs, narrowed by CUDA_VISIBLE_DEVICES."""
    try:
        present = sum(1 for _ in driver_list.iterdir())
    except OSError:
        return 0
    visible = env.get(ENV_CUDA_VISIBLE)
    if visible is None:
        return present
    return min(present, _visible_entries(visible))


@cache
def daemon_cuda_gpus() -> int:
    """The daemon's own count, read once: GPUs do not come and go under a running daemon."""
    return cuda_gpu_count(os.environ)
