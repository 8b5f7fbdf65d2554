"""Worker-side device selection, probes, memory counters and OOM handling.

CPU tests run for real everywhere. MPS cannot exist on the Linux machines these tests run on, so the MPS
paths that need a usable device replace only `probe` and check what must happen before any Metal call.
Tests marked `gpu` run only where torch sees a CUDA GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from mpsd.errors import ConfigError
from mpsd.worker import device as dev
from mpsd.worker import host as worker_host
from mpsd.worker.device import (
    DeviceInfo,
    DeviceUnavailable,
    _device_name,
    is_out_of_memory,
    memory_counters,
    probe,
    release_cached_memory,
    select_device,
    synchronize,
)

ROOT = Path(__file__).resolve().parent.parent
HAS_CUDA = torch.cuda.is_available()
HAS_MPS = torch.backends.mps.is_available()
no_gpu_here = pytest.mark.skipif(HAS_CUDA or HAS_MPS, reason="a GPU is present")


@pytest.fixture(autouse=True)
def fresh_device_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts as a fresh worker whose device no thread has used yet."""
    monkeypatch.setattr(dev, "_device_thread", dev._DeviceThread())
    yield


def usable_mps_only() -> Callable[[str], str | None]:
    """A probe that reports MPS usable and asks the real one about everything else."""

    def fake(device_type: str) -> str | None:
        return None if device_type == "mps" else probe(device_type)

    return fake


# --- CPU, for real -----------------------------------------------------------------------------------------


def test_cpu_probe_runs_a_kernel() -> None:
    assert probe("cpu") is None


def test_unknown_device_type_is_a_reason_not_a_crash() -> None:
    assert probe("tpu") == "unknown device type 'tpu'"


def test_select_cpu() -> None:
    device, info = select_device("KIND_CPU", None)
    assert device == torch.device("cpu")
    assert (info.kind, info.index, info.memory_fraction) == ("cpu", None, None)
    assert info.name
    assert info.as_dict() == {
        "kind": "cpu",
        "index": None,
        "name": info.name,
        "memory_fraction": None,
        "skipped": {},
    }


def test_cpu_does_not_apply_a_fraction() -> None:
    _, info = select_device("KIND_CPU", 0.5)
    assert info.memory_fraction is None


def test_fp64_is_fine_on_cpu() -> None:
    device, _ = select_device("KIND_CPU", None, ["TYPE_FP64"])
    assert device.type == "cpu"


@no_gpu_here
def test_auto_falls_back_to_cpu_without_a_gpu() -> None:
    device, info = select_device("KIND_AUTO", 0.5)
    assert device.type == "cpu"
    expected = DeviceInfo(kind="cpu", index=None, name=info.name, memory_fraction=None, skipped=info.skipped)
    assert info == expected
    # the GPUs it passed over, each with the probe's reason
    assert set(info.skipped) == {"mps", "cuda"} and all(info.skipped.values())
    _, explicit = select_device("KIND_CPU", None)
    assert explicit.skipped == {}


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown instance kind 'KIND_TPU'"):
        select_device("KIND_TPU", None)


# --- devices that do not exist here ------------------------------------------------------------------------


@pytest.mark.skipif(torch.backends.mps.is_built(), reason="this torch build has MPS")
def test_mps_requested_without_mps_fails_with_the_reason() -> None:
    assert probe("mps") == "this PyTorch build has no MPS support (MPS exists only in macOS builds)"
    with pytest.raises(DeviceUnavailable) as info:
        select_device("KIND_MPS", None)
    assert str(info.value) == (
        "KIND_MPS requested but MPS is not available: "
        "this PyTorch build has no MPS support (MPS exists only in macOS builds)"
    )


@no_gpu_here
@pytest.mark.skipif(sys.platform == "darwin", reason="KIND_GPU means MPS on macOS")
def test_gpu_requested_without_cuda_fails_with_the_reason() -> None:
    with pytest.raises(DeviceUnavailable, match=r"^KIND_GPU requested but CUDA is not available: \S"):
        select_device("KIND_GPU", None)


@pytest.mark.parametrize(("device_type", "name"), [("mps", "MPS"), ("cuda", "CUDA")])
def test_a_process_forked_after_the_device_was_initialised_is_reported(
    device_type: str, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/devices.md: the probe reports a process forked after the device was initialised, before any
    device call (a forked process hangs or crashes on its first Metal call). Neither device exists here,
    so the build's support and torch's own bad-fork flag are stood in; the real flag is read on a CUDA GPU
    below."""
    backend = torch.backends.mps if device_type == "mps" else torch.backends.cuda
    monkeypatch.setattr(backend, "is_built", lambda: True)
    monkeypatch.setattr(
        torch.mps if device_type == "mps" else torch.cuda, "_is_in_bad_fork", lambda: True, raising=False
    )
    assert probe(device_type) == (
        f"this process was forked after {name} was initialised; workers must be started with spawn"
    )


@pytest.mark.parametrize("kind", ["KIND_MPS", "KIND_AUTO"])
def test_fp64_on_mps_is_refused_before_any_metal_call(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # MPS cannot exist here: only the probe is replaced. A refusal that came after applying the fraction
    # would call torch.mps and fail differently.
    monkeypatch.setattr(dev, "probe", usable_mps_only())
    with pytest.raises(DeviceUnavailable) as info:
        select_device(kind, 0.5, ["TYPE_FP32", "TYPE_FP64"])
    assert str(info.value) == (
        f"{kind} resolved to MPS, which has no float64 support, but the model declares TYPE_FP64 "
        "inputs or outputs; declare TYPE_FP32 or use KIND_CPU"
    )


UINT16_ON_MPS = "Trying to convert UInt16 to the MPS backend but it does not have support for that dtype"


def test_a_declared_type_the_device_cannot_hold_refuses_the_model_at_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each declared type is copied to the device at load; MPS cannot exist here, so the device and its
    answer for UInt16 (torch's own message, pytorch#159076) are stood in. The load fails naming the type
    and the device, instead of every request failing."""
    monkeypatch.setattr(dev, "probe", usable_mps_only())
    probed: list[torch.dtype] = []

    def mps_copy(dtype: torch.dtype, device: torch.device) -> None:
        assert device.type == "mps"
        probed.append(dtype)
        if dtype == torch.uint16:
            raise TypeError(UINT16_ON_MPS)

    monkeypatch.setattr(dev, "probe_dtype", mps_copy)
    with pytest.raises(DeviceUnavailable) as info:
        select_device("KIND_MPS", None, ["TYPE_FP32", "TYPE_UINT16", "TYPE_STRING"])
    assert str(info.value) == (
        "KIND_MPS resolved to MPS, which cannot hold TYPE_UINT16, but the model declares TYPE_UINT16 inputs "
        f"or outputs ({UINT16_ON_MPS}); declare another type or use KIND_CPU"
    )
    assert set(probed) == {torch.float32, torch.uint16}  # strings never go to a device


def test_the_dtype_probe_copies_each_type_for_real() -> None:
    """The real probe, on the CPU (the one device here): every type torch holds is accepted."""
    from mpsd.worker.dtypes import TO_TORCH

    for dtype in TO_TORCH.values():
        dev.probe_dtype(dtype, torch.device("cpu"))


def test_without_proc_the_mapped_regions_are_taken_off_the_rss(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """macOS has no /proc/self/status (RssShmem): the sizes of the shared regions this process has mapped
    are taken off instead, so a region the worker touched is not counted against max_rss_bytes."""
    import psutil

    from mpsd.ipc import shm

    monkeypatch.setattr(dev, "_STATUS", tmp_path / "no-proc" / "status")
    size = 64 * 2**20
    before = shm.mapped_bytes()
    region = shm.Region.create(size)
    try:
        region.buf[:] = b"\1" * size  # every page resident
        assert shm.mapped_bytes() - before == size
        rss = psutil.Process().memory_info().rss
        private = dev.private_rss()
        assert private == pytest.approx(rss - shm.mapped_bytes(), abs=8 * 2**20)
        assert rss - private > size - 8 * 2**20
    finally:
        region.unlink()
        assert region.close()
    assert shm.mapped_bytes() == before


def test_mps_fraction_out_of_range_names_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "probe", usable_mps_only())
    with pytest.raises(ConfigError, match=r"out of range for mps: allowed \[0\.0, 2\.0\]"):
        select_device("KIND_MPS", 2.5)


def test_cuda_fraction_out_of_range_names_the_range(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dev, "probe", lambda device_type: None)
    monkeypatch.setattr(sys, "platform", "linux")
    with pytest.raises(ConfigError, match=r"out of range for cuda: allowed \(0\.0, 1\.0\]"):
        select_device("KIND_GPU", 0.0)


# --- one device thread -------------------------------------------------------------------------------------


def run_in_thread(fn: Callable[[], object]) -> BaseException | None:
    errors: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    return errors[0] if errors else None


def test_select_device_from_a_second_thread_is_refused() -> None:
    select_device("KIND_CPU", None)
    error = run_in_thread(lambda: select_device("KIND_CPU", None))
    assert isinstance(error, RuntimeError)
    assert "all device work in a worker must run on one thread" in str(error)


def test_gpu_calls_from_a_second_thread_are_refused_before_touching_the_gpu() -> None:
    select_device("KIND_CPU", None)
    cuda = torch.device("cuda", 0)
    for error in (
        run_in_thread(lambda: synchronize(cuda)),
        run_in_thread(lambda: release_cached_memory(cuda)),
    ):
        assert isinstance(error, RuntimeError)
        assert "must run on one thread" in str(error)


def test_cpu_helpers_and_counters_work_from_any_thread() -> None:
    select_device("KIND_CPU", None)
    cpu = torch.device("cpu")

    def cpu_calls() -> None:
        synchronize(cpu)
        release_cached_memory(cpu)
        memory_counters(cpu)

    assert run_in_thread(cpu_calls) is None


# --- memory ------------------------------------------------------------------------------------------------


def test_cpu_counters_are_rss_only() -> None:
    counters = memory_counters(torch.device("cpu"))
    assert set(counters) == {"rss_bytes"}
    assert counters["rss_bytes"] > 0


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux: RssShmem in /proc/self/status")
def test_shared_memory_the_worker_maps_is_not_counted_as_its_own() -> None:
    """The regions and arenas a worker maps (a CUDA worker page-locks them, all resident) are the daemon's
    buffers: a worker's memory ceiling must not count them."""
    import psutil

    from mpsd.ipc.shm import Region

    region = Region.create(64 << 20)
    try:
        before_rss = psutil.Process().memory_info().rss
        before = memory_counters(torch.device("cpu"))["rss_bytes"]
        for page in range(0, region.size, 4096):  # every page resident, with no large buffer of our own
            region.buf[page] = 1
        assert psutil.Process().memory_info().rss - before_rss >= 48 << 20  # the plain RSS counts it
        assert memory_counters(torch.device("cpu"))["rss_bytes"] - before < 16 << 20
    finally:
        region.unlink()
        region.close()


def test_cuda_style_oom_is_detected() -> None:
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "1.10 GiB is free."
    )
    assert is_out_of_memory(exc)


def test_mps_style_oom_is_detected() -> None:
    exc = RuntimeError(
        "MPS backend out of memory (MPS allocated: 17.11 GiB, other allocations: 1.34 GiB, max allowed: "
        "18.13 GiB). Tried to allocate 256.00 MiB on private pool. Use PYTORCH_MPS_HIGH_WATERMARK_RATIO=0.0 "
        "to disable upper limit for memory allocations (may cause system failure)."
    )
    assert is_out_of_memory(exc)


def test_real_cpu_allocation_failure_is_detected() -> None:
    with pytest.raises(RuntimeError) as info:
        torch.empty(1 << 60, dtype=torch.uint8)
    assert is_out_of_memory(info.value)


def test_oom_wrapped_by_a_backend_is_detected() -> None:
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")
        except torch.OutOfMemoryError as inner:
            raise RuntimeError("forward() failed") from inner
    except RuntimeError as outer:
        assert is_out_of_memory(outer)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"),
        ValueError("CUDA out of memory"),
        TypeError("Cannot convert a MPS Tensor to float64 dtype"),
    ],
)
def test_other_errors_are_not_oom(exc: BaseException) -> None:
    assert not is_out_of_memory(exc)


# --- CUDA, where there is one ------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_selection_fraction_counters_and_oom_recovery() -> None:
    assert probe("cuda") is None
    device, info = select_device("KIND_GPU", 0.25)
    assert device == torch.device("cuda", 0)
    assert (info.kind, info.index, info.memory_fraction) == ("cuda", 0, 0.25)
    assert info.name == torch.cuda.get_device_name(0)
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        assert getter(device) == pytest.approx(0.25)

    before = memory_counters(device)
    assert set(before) == {"allocated_bytes", "reserved_bytes", "total_bytes", "rss_bytes"}
    block = torch.ones(64 << 20, dtype=torch.uint8, device=device)
    synchronize(device)
    during = memory_counters(device)
    assert during["allocated_bytes"] >= before["allocated_bytes"] + (64 << 20)
    del block

    # Half the GPU is above the 0.25 cap: the allocator must refuse it even though the GPU has room.
    with pytest.raises(torch.OutOfMemoryError) as info_oom:
        torch.empty(before["total_bytes"] // 2, dtype=torch.uint8, device=device)
    assert is_out_of_memory(info_oom.value)
    assert "out of memory" in str(info_oom.value).lower()
    del info_oom
    release_cached_memory(device)
    assert memory_counters(device)["reserved_bytes"] <= during["reserved_bytes"]

    # The worker keeps serving after the OOM.
    x = torch.arange(1024, dtype=torch.float32, device=device)
    assert float(x.sum().item()) == 1023 * 1024 / 2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_a_real_fork_after_cuda_was_initialised_is_reported() -> None:
    """The same with torch's real flag: a child forked after its parent initialised CUDA is refused by the
    probe, which makes no CUDA call that would fail in the child."""
    script = (
        "import os, sys, torch\n"
        "from mpsd.worker.device import probe\n"
        "torch.ones(1, device='cuda')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.stdout.write(str(probe('cuda')))\n"
        "    sys.stdout.flush()\n"
        "    os._exit(0)\n"
        "os.waitpid(pid, 0)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == (
        "this process was forked after CUDA was initialised; workers must be started with spawn"
    ), done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_hidden_gpus_make_gpu_fail_and_auto_fall_back() -> None:
    script = (
        "from mpsd.worker.device import select_device, DeviceUnavailable\n"
        "try:\n    select_device('KIND_GPU', None)\nexcept DeviceUnavailable as e:\n    print('GPU:', e)\n"
        "print('AUTO:', select_device('KIND_AUTO', 0.5)[1].kind)\n"
    )
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    ).stdout
    assert "GPU: KIND_GPU requested but CUDA is not available: " in out
    assert "CUDA_VISIBLE_DEVICES=''" in out
    assert "AUTO: cpu" in out


def test_region_cache_unpins_before_unmapping_and_keeps_borrowed_regions_pinned() -> None:
    """The pin hook's contract, with a recording hook (page-locking itself needs CUDA: next test)."""
    from mpsd.ipc.protocol import RegionRef
    from mpsd.ipc.shm import Region
    from mpsd.worker.inference import region_view
    from mpsd.worker.regions import RegionCache

    events: list[str] = []

    def pin(buf: memoryview) -> Callable[[], None]:
        key = f"{len(buf)}"
        events.append(f"pin {key}")
        return lambda: events.append(f"unpin {key}")

    first, second, third = Region.create(4096), Region.create(8192), Region.create(16384)
    try:
        cache = RegionCache(pin)
        region = cache.get("input", RegionRef(first.name, first.size))
        cached = region_view(region, cache.views("input"), 0, 16)  # kept in the cache: dropped on retirement
        borrowed = region_view(region, {}, 0, 16)[:8]  # held elsewhere: keeps the mapping alive
        del cached
        cache.get("input", RegionRef(second.name, second.size))  # first is retired, but borrowed
        assert not cache.views("input"), "views of a replaced region are dropped"
        assert events == ["pin 4096", "pin 8192", "unpin 4096", "pin 4096"], "unpinned to try, pinned again"
        del borrowed
        events.clear()
        cache.get("output", RegionRef(third.name, third.size))  # retirement tried again: now it goes
        assert events == ["pin 16384", "unpin 4096"]
        assert first.buf[:1] == b"\x00", "the creator's own mapping is untouched"
    finally:
        for r in (first, second, third):
            r.unlink()


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_pins_shared_memory_and_copies_from_it() -> None:
    from mpsd.ipc.shm import Region

    region = Region.create(1 << 20)
    try:
        region.buf[:8] = bytes(range(8))
        pin = worker_host.host_pinner(torch.device("cuda", 0))
        assert pin is not None
        unpin = pin(region.buf)
        assert unpin is not None, "cudaHostRegister refused a shared-memory mapping"
        host = torch.frombuffer(region.buf, dtype=torch.uint8)
        assert host.is_pinned()
        on_gpu = host.to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert on_gpu[:8].tolist() == list(range(8))
        del host
        unpin()
        assert not torch.frombuffer(region.buf, dtype=torch.uint8).is_pinned()
        assert worker_host.host_pinner(torch.device("cpu")) is None
    finally:
        region.unlink()
        region.close()


def test_tensor_views_on_a_region_are_reused_and_their_number_is_bounded() -> None:
    """Views over shared memory are built once per place; shapes that vary without end do not grow the
    cache past its limit (it starts again), and every view still reads the region's current bytes."""
    import numpy as np

    from mpsd.ipc.shm import Region
    from mpsd.worker.inference import VIEWS_LIMIT, region_view

    region = Region.create(1 << 16)
    try:
        views: dict[object, object] = {}
        first = region_view(region, views, 0, 8)  # type: ignore[arg-type]
        assert region_view(region, views, 0, 8) is first  # type: ignore[arg-type]
        for n in range(1, 3 * VIEWS_LIMIT):
            view = region_view(region, views, 0, n)  # type: ignore[arg-type]
            assert len(views) <= VIEWS_LIMIT
        region.buf[:4] = bytes([1, 2, 3, 4])
        assert np.asarray(view[:4]).tolist() == [1, 2, 3, 4]
        del first, view
        views.clear()
    finally:
        region.unlink()
        region.close()


# --- torch versions: APIs newer than the declared floor (torch 2.4) have fallbacks --------------------------
# MPS cannot run here: the torch.mps functions the counters call are replaced by stand-ins that return fixed
# numbers, and the newer APIs are removed, as on the older torch releases that lack them.


def test_mps_device_name_without_get_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch.backends.mps, "get_name", raising=False)  # added in torch 2.9
    assert _device_name(torch.device("mps")) == "Apple GPU (MPS)"
    monkeypatch.setattr(torch.backends.mps, "get_name", lambda: "Apple M3 Max", raising=False)
    assert _device_name(torch.device("mps")) == "Apple M3 Max (MPS)"


def test_mps_counters_without_recommended_max_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.mps, "current_allocated_memory", lambda: 1000)
    monkeypatch.setattr(torch.mps, "driver_allocated_memory", lambda: 2000)
    monkeypatch.setattr(torch.mps, "recommended_max_memory", lambda: 3000, raising=False)
    with_it = memory_counters(torch.device("mps"))
    assert (with_it["current_allocated_bytes"], with_it["recommended_max_bytes"]) == (1000, 3000)
    monkeypatch.delattr(torch.mps, "recommended_max_memory")  # added in torch 2.5
    without = memory_counters(torch.device("mps"))
    assert "recommended_max_bytes" not in without
    assert without["driver_allocated_bytes"] == 2000


def test_out_of_memory_recognised_under_its_pre_2_4_name(monkeypatch: pytest.MonkeyPatch) -> None:
    error = torch.cuda.OutOfMemoryError("CUDA error: out of memory (allocator)")
    monkeypatch.delattr(torch, "OutOfMemoryError")  # the top-level name arrived in torch 2.4
    assert is_out_of_memory(error)
    assert not is_out_of_memory(ValueError("no"))


def test_kind_gpu_with_the_mps_accelerator_falls_back_and_says_why() -> None:
    """Triton's mps accelerator: MPS where usable, else CUDA, else the CPU, each device passed over with
    its reason. Plain KIND_GPU stays strict; so does KIND_MPS."""
    device, info = select_device("KIND_GPU", 0.5, accelerator="mps")
    if HAS_MPS:
        assert device.type == "mps" and info.skipped == {}
        return
    assert info.skipped.get("mps")
    if HAS_CUDA:
        assert device.type == "cuda" and info.memory_fraction == 0.5
    else:
        assert device.type == "cpu" and info.memory_fraction is None
        assert "cuda" in info.skipped
        with pytest.raises(DeviceUnavailable, match="KIND_GPU requested but CUDA is not available"):
            select_device("KIND_GPU", None)
    with pytest.raises(DeviceUnavailable, match="KIND_MPS requested but MPS is not available"):
        select_device("KIND_MPS", None, accelerator="mps")


# --- host threads ------------------------------------------------------------------------------------------


@pytest.fixture
def torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No thread setting in the environment, and torch's own thread count put back afterwards."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("torch_threads")
def test_an_mps_worker_keeps_a_few_host_threads_for_the_operators_that_fall_back_to_the_cpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 10)
    torch.set_num_threads(1)
    assert worker_host.limit_host_threads(torch.device("mps")) == 4
    assert torch.get_num_threads() == 4
    monkeypatch.setattr(os, "cpu_count", lambda: 2)  # never more than one per core
    assert worker_host.limit_host_threads(torch.device("mps")) == 2
    assert torch.get_num_threads() == 2
    assert worker_host.host_threads("mps", None) == 1


@pytest.mark.usefixtures("torch_threads")
def test_a_cuda_worker_gets_one_host_thread_and_a_thread_setting_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.set_num_threads(2)
    assert worker_host.limit_host_threads(torch.device("cuda")) == 1
    assert torch.get_num_threads() == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the model's intra_op_thread_count
    assert worker_host.limit_host_threads(torch.device("mps")) is None
    assert worker_host.limit_host_threads(torch.device("cpu")) is None
    assert torch.get_num_threads() == 1  # left as it was
