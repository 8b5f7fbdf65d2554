"""The interpreter, torch's build, and the device a KIND_AUTO model gets, found by the worker's own probes."""

from __future__ import annotations

import sys

from mpsd import osfacts
from mpsd.tools.doctor.report import Check, failed, passed

MIN_PYTHON = (3, 10)
GIB = 1024**3


def python_version() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    venv = "a venv" if sys.prefix != sys.base_prefix else "no venv"
    detail = f"{version} at {sys.executable} ({venv})"
    if sys.version_info[:2] < MIN_PYTHON:
        return failed(
            "python",
            f"{detail}: mpsd needs {'.'.join(map(str, MIN_PYTHON))} or newer",
            "install a newer Python (macOS: `brew install python@3.12`), remove .venv and run `make install`",
        )
    return passed("python", f"{detail}, >= {'.'.join(map(str, MIN_PYTHON))}")


def torch_build() -> Check:
    try:
        import torch
    except Exception as exc:
        return failed(
            "torch", f"cannot import torch: {exc}", "run `make install` (it installs torch into .venv)"
        )
    mps = torch.backends.mps
    cuda_built = torch.backends.cuda.is_built()  # type: ignore[no-untyped-call]
    cuda_ok = torch.cuda.is_available()
    parts = [
        torch.__version__,
        f"MPS built {_yes(mps.is_built())}, available {_yes(mps.is_available())}",
        f"CUDA built {_yes(cuda_built)}"
        + (f" ({torch.version.cuda}), available {_yes(cuda_ok)}" if cuda_built else ""),
        f"{torch.cuda.device_count() if cuda_ok else 0} CUDA devices",
    ]
    return passed("torch", "; ".join(parts))


def _yes(value: bool) -> str:
    return "yes" if value else "no"


def _memory(device_type: str) -> str:
    """How much memory the device offers a model: Metal's recommended working set on MPS, the GPU's free and
    total memory on CUDA, the host's RAM on the CPU."""
    import psutil
    import torch

    if device_type == "mps":
        recommended = getattr(torch.mps, "recommended_max_memory", None)  # torch 2.5 and later
        ram = psutil.virtual_memory().total / GIB
        if recommended is None:
            return f"{ram:.1f} GiB RAM shared with the CPU"
        return (
            f"recommended working set {recommended() / GIB:.1f} GiB of {ram:.1f} GiB RAM shared with the CPU"
        )
    if device_type == "cuda":
        free, total = torch.cuda.mem_get_info(0)
        return f"{free / GIB:.1f} GiB free of {total / GIB:.1f} GiB"
    memory = psutil.virtual_memory()
    pool = " (one pool with the GPU)" if osfacts.current().unified_memory else ""
    return f"{memory.available / GIB:.1f} GiB available of {memory.total / GIB:.1f} GiB RAM{pool}"


def auto_device() -> Check:
    """What a KIND_AUTO instance resolves to here: the daemon's placement says what it prefers, the worker's
    probes (allocate, compute, synchronize) what works."""
    from mpsd.daemon.supervise.placement import InstancePlacement
    from mpsd.worker.device import DeviceUnavailable, select_device

    preferred = InstancePlacement(
        group=0, index=0, kind="KIND_AUTO", gpu=None, memory_fraction=None
    ).device_type
    try:
        device, info = select_device("KIND_AUTO", None)
    except DeviceUnavailable as exc:
        return failed("device", str(exc), "see docs/troubleshooting.md")
    detail = f"KIND_AUTO gets {device} ({info.name}), {_memory(device.type)}"
    if info.skipped:
        detail += "; passed over: " + "; ".join(f"{k}: {v}" for k, v in info.skipped.items())
    if preferred == "mps" and device.type != "mps":
        return failed(
            "device",
            detail,
            "MPS needs macOS 14 or newer on Apple Silicon and torch's macOS arm64 build; see "
            "docs/troubleshooting.md (MPS unavailable)",
        )
    return passed("device", detail)
