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

import structlog

from mpsd.daemon.supervise.placement import ENV_CUDA_VISIBLE

log = structlog.get_logger("mpsd.daemon.supervise.gpus")

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")


def _visible_entries(value: str, present: int) -> int:
    """How many of the `present` GPUs a `CUDA_VISIBLE_DEVICES` value leaves visible, by CUDA's rules: the
    list ends at the first entry that names no GPU (empty, below zero, or an index past the last: "-1"
    hides them all, "1,5" on two GPUs means one), and an index given twice hides every GPU. Entries that
    are not indices (GPU-<uuid>, MIG-<uuid>) are counted as given."""
    count = 0
    indices: set[int] = set()
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            break
        if entry.lstrip("-").isdigit():
            index = int(entry)
            if index < 0 or index >= present:
                break
            if index in indices:
                return 0
            indices.add(index)
        count += 1
    return min(count, present)


def cuda_gpu_count(env: Mapping[str, str], driver_list: Path = NVIDIA_GPUS) -> int:
    """The GPUs a process started with `env` may use: the driver's GPUs, narrowed by CUDA_VISIBLE_DEVICES."""
    try:
        present = sum(1 for _ in driver_list.iterdir())
    except OSError:
        return 0
    visible = env.get(ENV_CUDA_VISIBLE)
    return present if visible is None else _visible_entries(visible, present)


@cache
def daemon_cuda_gpus() -> int:
    """The daemon's own count, read once (when the first model is planned): GPUs do not come and go under
    a running daemon."""
    count = cuda_gpu_count(os.environ)
    log.info("cuda gpus counted", gpus=count, cuda_visible_devices=os.environ.get(ENV_CUDA_VISIBLE))
    return count
