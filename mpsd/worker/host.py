"""The worker's host side of an accelerator: few CPU threads for its own copies, and shared-memory mappings
page-locked for the GPU's DMA. Apart from device selection (`device.py`), because neither decides where
the model runs: both follow from it, once, while the worker loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch

# CPU threads of a worker whose model runs on an accelerator.
ACCELERATOR_HOST_THREADS = 1
# On MPS, at most this many: operators MPS lacks fall back to the CPU (`mps_fallback`, on by default).
MPS_HOST_THREADS = 4


def host_threads(device_type: str, cpus: int | None) -> int:
    """The CPU threads of a worker whose model runs on `device_type` (not the CPU) on `cpus` cores."""
    if device_type == "mps":
        return max(1, min(MPS_HOST_THREADS, cpus or 1))
    return ACCELERATOR_HOST_THREADS


def limit_host_threads(device: torch.device) -> int | None:
    """On an accelerator, run the worker's own CPU work (copies in and out of shared memory) on few threads.

    torch sizes its CPU thread team to the machine. In a GPU worker that team only speeds up host copies,
    and after each one its idle threads spin: on a 16-core host one ResNet-50 worker burned about 8 cores
    that way, taking them from the daemon and its fronts. CUDA workers get one thread. MPS workers get a
    few (`MPS_HOST_THREADS`, at most one per core): the operators MPS lacks run on the CPU there, and one
    thread would make each of them slow. OMP_NUM_THREADS or MKL_NUM_THREADS in the environment (the model's
    `intra_op_thread_count` sets the first) win. Returns the thread count set, None when left alone.
    """
    if device.type == "cpu" or "OMP_NUM_THREADS" in os.environ or "MKL_NUM_THREADS" in os.environ:
        return None
    threads = host_threads(device.type, os.cpu_count())
    torch.set_num_threads(threads)
    return threads


def host_pinner(device: torch.device) -> Callable[[memoryview], Callable[[], None] | None] | None:
    """For CUDA: page-lock shared-memory mappings, so inputs go to the GPU by DMA without a staging copy.

    From pageable memory the driver copies through its own pinned buffer, on the CPU; a registered
    mapping is copied by the GPU itself. Registration fails harmlessly (the copy stays pageable) where the
    driver refuses it. None for other devices.
    """
    if device.type != "cuda":
        return None
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]

    def pin(buf: memoryview) -> Callable[[], None] | None:
        view = torch.frombuffer(buf, dtype=torch.uint8)
        pointer, size = view.data_ptr(), view.numel()
        del view  # the address stays valid for as long as the mapping does
        if size == 0 or int(cudart.cudaHostRegister(pointer, size, 0)) != 0:
            clear_error()
            return None

        def unpin() -> None:
            if int(cudart.cudaHostUnregister(pointer)) != 0:
                clear_error()

        return unpin

    def clear_error() -> None:
        """So a refused call is not reported later by an unrelated kernel launch."""
        clear = getattr(cudart, "cudaGetLastError", None)
        if clear is not None:
            clear()

    return pin
