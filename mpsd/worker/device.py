"""The worker's device: resolve an instance kind to a usable torch device, cap its memory, report counters.

Runs inside the worker process, after the daemon has prepared the environment (`CUDA_VISIBLE_DEVICES`,
`PYTORCH_ENABLE_MPS_FALLBACK`, the MPS watermark ratios; see `mpsd.daemon.supervise.placement`),
because PyTorch reads those variables once, at import or at the first allocation. CUDA and MPS sit
behind the same functions so that the rest of the worker never branches on the backend.

Usability is probed for real (allocate, run a kernel, synchronize, check the result): `is_available()` is
cached for the process lifetime and reports True in VMs and sandboxes where the first allocation then fails.
"""

from __future__ import annotations

import gc
import os
import platform
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil
import torch

from mpsd.errors import ConfigError
from mpsd.ipc.dtypes import config_to_wire
from mpsd.ipc.shm import mapped_bytes
from mpsd.worker.completions import CompletionFactory, completions
from mpsd.worker.device_time import ExecutionTimer, timing_events
from mpsd.worker.dtypes import TO_TORCH

# Substrings of allocator messages that mean "out of memory" even when the exception type was lost, e.g. an
# OOM raised inside a TorchScript module surfaces as torch.jit.Error, and MPS raises a plain RuntimeError.
_OOM_MARKERS = (
    "CUDA out of memory",
    "MPS backend out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)

# (lowest, highest, lowest is allowed) per device type; these are the ranges torch itself enforces.
_FRACTION_RANGES: dict[str, tuple[float, float, bool]] = {
    "cuda": (0.0, 1.0, False),
    "mps": (0.0, 2.0, True),
}

_PROBE_SIZE = 16
_PROBE_EXPECTED = float(sum(2 * i + 1 for i in range(_PROBE_SIZE)))


class DeviceUnavailable(Exception):
    """The requested device cannot be used in this process; the message is the reason, meant for operators."""


@dataclass(frozen=True)
class DeviceInfo:
    """What the worker runs on, as reported to the daemon and in metadata."""

    kind: str  # "cpu" | "cuda" | "mps"
    index: int | None
    name: str
    memory_fraction: float | None
    # Devices KIND_AUTO passed over on its way here, with the probe's reason: why a model meant for the
    # GPU runs on the CPU is then in the daemon's log, not only in a reader's guess.
    skipped: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class _DeviceThread:
    """Remembers the thread that first used the device: MPS crashes (SIGSEGV, Metal assertions) when two
    threads issue work concurrently, so every device call must come from that one thread."""

    def __init__(self) -> None:
        self._ident: int | None = None
        self._lock = threading.Lock()

    def enter(self, what: str) -> None:
        current = threading.get_ident()
        with self._lock:
            if self._ident is None:
                self._ident = current
            elif self._ident != current:
                raise RuntimeError(
                    f"{what} called from thread {current}, but the device belongs to thread {self._ident}: "
                    "all device work in a worker must run on one thread (MPS crashes when two threads use it)"
                )


_device_thread = _DeviceThread()


def _bad_fork(device_type: str) -> bool:
    """True when this process was forked from one that had initialised the device (MPS hangs or crashes)."""
    module = torch.mps if device_type == "mps" else torch.cuda
    check = getattr(module, "_is_in_bad_fork", None)
    return bool(check()) if callable(check) else False


def _unusable_reason(device_type: str) -> str | None:
    """Cheap checks before touching the device; returns why it cannot work, or None."""
    if device_type == "cuda":
        if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
            return "this PyTorch build has no CUDA support"
        if _bad_fork("cuda"):
            return "this process was forked after CUDA was initialised; workers must be started with spawn"
        if not torch.cuda.is_available():
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
            return f"torch.cuda.is_available() is False: no driver or no visible GPU{shown}"
        return None
    if device_type == "mps":
        if not torch.backends.mps.is_built():
            return "this PyTorch build has no MPS support (MPS exists only in macOS builds)"
        if _bad_fork("mps"):
            return "this process was forked after MPS was initialised; workers must be started with spawn"
        if not torch.backends.mps.is_available():
            return (
                "torch.backends.mps.is_available() is False: MPS needs macOS 14 or newer and a Metal GPU, "
                "and is missing in some VMs, sandboxes and non-GUI sessions"
            )
        return None
    if device_type == "cpu":
        return None
    return f"unknown device type {device_type!r}"


def probe(device_type: str) -> str | None:
    """Allocate a tensor on the device, run a small kernel, synchronize and check the result.

    Returns None when the device works, else the reason it does not; never raises for a device failure.
    """
    reason = _unusable_reason(device_type)
    if reason is not None:
        return reason
    device = torch.device(device_type)
    if device.type != "cpu":
        _device_thread.enter("probe")
    try:
        x = torch.arange(_PROBE_SIZE, dtype=torch.float32, device=device)
        y = (x * 2.0 + 1.0).sum()
        synchronize(device)
        value = float(y.item())
    except Exception as exc:
        return f"probe on {device_type} failed: {type(exc).__name__}: {exc}"
    if value != _PROBE_EXPECTED:
        return f"probe on {device_type} computed {value} instead of {_PROBE_EXPECTED}: wrong results"
    return None


def _resolve(kind: str, skipped: dict[str, str] | None = None) -> str:
    """The device type a kind resolves to here, or DeviceUnavailable with the probe's reason. KIND_AUTO
    records the devices it passed over, and why, in `skipped`."""
    if kind == "KIND_CPU":
        reason = probe("cpu")
        if reason is not None:
            raise DeviceUnavailable(f"KIND_CPU requested but the CPU probe failed: {reason}")
        return "cpu"
    if kind == "KIND_MPS":
        reason = probe("mps")
        if reason is not None:
            raise DeviceUnavailable(f"KIND_MPS requested but MPS is not available: {reason}")
        return "mps"
    if kind == "KIND_GPU":
        if sys.platform == "darwin":
            reason = probe("mps")
            if reason is not None:
                raise DeviceUnavailable(
                    f"KIND_GPU requested but MPS (the GPU on macOS) is not available: {reason}"
                )
            return "mps"
        reason = probe("cuda")
        if reason is not None:
            raise DeviceUnavailable(f"KIND_GPU requested but CUDA is not available: {reason}")
        return "cuda"
    if kind == "KIND_AUTO":
        reasons: list[str] = []
        for device_type in ("mps", "cuda", "cpu"):
            reason = probe(device_type)
            if reason is None:
                return device_type
            reasons.append(f"{device_type}: {reason}")
            if skipped is not None:
                skipped[device_type] = reason
        raise DeviceUnavailable(f"KIND_AUTO found no usable device ({'; '.join(reasons)})")
    raise ValueError(f"unknown instance kind {kind!r}; expected KIND_AUTO, KIND_GPU, KIND_MPS or KIND_CPU")


def _check_fraction(device_type: str, fraction: float) -> None:
    """Refuse a fraction outside the range torch accepts for this device, naming that range."""
    lowest, highest, lowest_ok = _FRACTION_RANGES[device_type]
    in_range = (lowest <= fraction if lowest_ok else lowest < fraction) and fraction <= highest
    if not in_range:
        opening = "[" if lowest_ok else "("
        raise ConfigError(
            f"memory_fraction {fraction} is out of range for {device_type}: "
            f"allowed {opening}{lowest}, {highest}]"
        )


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        get_name = getattr(torch.backends.mps, "get_name", None)  # torch 2.9 and later
        return f"{get_name() if get_name is not None else 'Apple GPU'} (MPS)"
    return platform.processor() or platform.machine() or "cpu"


def select_device(
    kind: str,
    memory_fraction: float | None,
    config_dtypes: Sequence[str] = (),
    accelerator: str | None = None,
) -> tuple[torch.device, DeviceInfo]:
    """Resolve `kind` with real probes, refuse FP64 on MPS, apply the memory fraction before the model loads,
    then refuse a declared type the device cannot hold (a copy of each to the device).

    CUDA is always `cuda:0`: the daemon pins a GPU with `CUDA_VISIBLE_DEVICES`. On CPU the fraction is not
    applied (the daemon refuses one for KIND_CPU; KIND_AUTO that falls back to CPU drops it) and the returned
    info says `memory_fraction=None`.
    """
    _device_thread.enter("select_device")
    skipped: dict[str, str] = {}
    # Triton's mps accelerator: MPS where it is usable, else what KIND_AUTO would take (CUDA, then the CPU),
    # with the devices passed over and why, where plain KIND_GPU would fail.
    fallback = kind == "KIND_GPU" and accelerator == "mps"
    device_type = _resolve("KIND_AUTO" if fallback else kind, skipped)
    if device_type == "mps":
        fp64 = sorted({d for d in config_dtypes if config_to_wire(d) == "FP64"})
        if fp64:
            raise DeviceUnavailable(
                f"{kind} resolved to MPS, which has no float64 support, but the model declares "
                f"{', '.join(fp64)} inputs or outputs; declare TYPE_FP32 or use KIND_CPU"
            )
    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    applied: float | None = None
    if memory_fraction is not None and device_type != "cpu":
        fraction = float(memory_fraction)
        _check_fraction(device_type, fraction)
        if device_type == "cuda":
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        else:
            torch.mps.set_per_process_memory_fraction(fraction)
        applied = fraction
    if device_type != "cpu":
        _check_dtypes(kind, device, config_dtypes)
    index = None if device_type == "cpu" else 0
    return device, DeviceInfo(
        kind=device_type, index=index, name=_device_name(device), memory_fraction=applied, skipped=skipped
    )


def probe_dtype(dtype: torch.dtype, device: torch.device) -> None:
    """Copy a one-element tensor of `dtype` to `device`; raises where the backend cannot hold the type."""
    torch.zeros(1, dtype=dtype).to(device)


def _check_dtypes(kind: str, device: torch.device, config_dtypes: Sequence[str]) -> None:
    """Refuse at load a declared type the device cannot hold (MPS lacks some unsigned types in some torch
    releases), naming it and the device: otherwise every request would fail with the backend's message."""
    for data_type in sorted(set(config_dtypes)):
        dtype = TO_TORCH.get(config_to_wire(data_type))
        if dtype is None:  # strings: never on a device
            continue
        try:
            probe_dtype(dtype, device)
        except (RuntimeError, TypeError) as exc:
            raise DeviceUnavailable(
                f"{kind} resolved to {device.type.upper()}, which cannot hold {data_type}, but the model "
                f"declares {data_type} inputs or outputs ({exc}); declare another type or use KIND_CPU"
            ) from None


def synchronize(device: torch.device) -> None:
    """Wait for all queued kernels: needed before timing and before trusting that work has finished."""
    if device.type == "cuda":
        _device_thread.enter("synchronize")
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        _device_thread.enter("synchronize")
        torch.mps.synchronize()


def execution_timer(device: torch.device) -> ExecutionTimer | None:
    """Timing events around each model call on CUDA and MPS, read after the worker's own synchronize; None
    on the CPU, which has no device time to report."""
    new_event = timing_events(device.type)
    if new_event is None:
        return None
    _device_thread.enter("execution_timer")
    return ExecutionTimer(new_event)


def completion(device: torch.device) -> CompletionFactory | None:
    """Completion events on this device, where executions may overlap (CUDA); None elsewhere."""
    return completions(device.type)


def memory_counters(device: torch.device) -> dict[str, int]:
    """Allocator counters for the device plus the process RSS (MPS leaks show up in RSS, not in its counters).

    Read-only queries of the allocator, so they may come from a reporting thread.
    """
    counters: dict[str, int] = {}
    if device.type == "cuda":
        counters["allocated_bytes"] = int(torch.cuda.memory_allocated(device))
        counters["reserved_bytes"] = int(torch.cuda.memory_reserved(device))
        counters["total_bytes"] = int(torch.cuda.get_device_properties(device).total_memory)
    elif device.type == "mps":
        counters["current_allocated_bytes"] = int(torch.mps.current_allocated_memory())
        counters["driver_allocated_bytes"] = int(torch.mps.driver_allocated_memory())
        recommended = getattr(torch.mps, "recommended_max_memory", None)  # torch 2.5 and later
        if recommended is not None:
            counters["recommended_max_bytes"] = int(recommended())
    counters["rss_bytes"] = private_rss()
    return counters


_STATUS = Path("/proc/self/status")


def private_rss() -> int:
    """The process's resident memory less the shared memory mapped into it: the daemon's regions and the
    fronts' arenas, which a CUDA worker page-locks (all resident) and which are the daemon's buffers, not
    the model's memory. Linux says how much of it is resident (RssShmem); where there is no /proc (macOS)
    the sizes of the regions mapped are taken off, which may count a page never touched."""
    rss = int(psutil.Process().memory_info().rss)
    try:
        status = _STATUS.read_text()
    except OSError:
        return max(0, rss - mapped_bytes())
    for line in status.splitlines():
        if line.startswith("RssShmem:"):
            return max(0, rss - int(line.split()[1]) * 1024)
    return rss


def _oom_type() -> type[BaseException]:
    """The allocators' out-of-memory error: `torch.OutOfMemoryError` from torch 2.4, the same class under
    its older name `torch.cuda.OutOfMemoryError` before."""
    found = getattr(torch, "OutOfMemoryError", None) or torch.cuda.OutOfMemoryError
    return found  # type: ignore[no-any-return]


def is_out_of_memory(exc: BaseException) -> bool:
    """True for an allocator OOM, also when wrapped or re-raised as another type (MPS raises RuntimeError)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, _oom_type()):
            return True
        if isinstance(current, RuntimeError) and any(m in str(current) for m in _OOM_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False


def release_cached_memory(device: torch.device) -> None:
    """Return the allocator's cached blocks after an OOM or unload so the worker can keep serving.

    Call it after leaving the `except` block: the exception's traceback keeps the failed request's tensors
    alive until then.
    """
    gc.collect()
    if device.type == "cuda":
        _device_thread.enter("release_cached_memory")
        with torch.cuda.device(device):
            torch.cuda.empty_cache()
    elif device.type == "mps":
        _device_thread.enter("release_cached_memory")
        torch.mps.empty_cache()
