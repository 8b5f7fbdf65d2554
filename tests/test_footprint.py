"""An instance's footprint (`footprint`), alone: docs/memory.md's order, in bytes. What it declares; else its
cap (`max_rss_bytes` on the CPU; `max_device_memory_bytes`, or `memory_fraction` x the device's size, on a
GPU); else what the version measured when it last ran; else 0. On Linux here: cpu and cuda are budgets of
their own (unified memory is macOS's, `test_unified_memory.py`)."""

from __future__ import annotations

from typing import Any

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core.residency.footprint import footprint
from mpsd.daemon.supervise.device_memory import DeviceSizes
from mpsd.daemon.supervise.placement import InstancePlacement

GIB = 2**30
CPU = InstancePlacement(0, 0, "KIND_CPU", None, None, "linux")
GPU_HALF = InstancePlacement(0, 0, "KIND_GPU", 0, 0.5, "linux")


def config(**fields: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
            **fields,
        }
    )


def sizes() -> DeviceSizes:
    known = DeviceSizes(lambda: 64 * GIB)
    known.learn("cuda:0", {"total_bytes": 80 * GIB})  # as a worker's snapshot tells it
    return known


def test_a_cpu_instance_holds_its_max_rss_bytes_cap_when_nothing_is_declared() -> None:
    got = footprint(config(max_rss_bytes=3 * GIB), [CPU], sizes(), measured=GIB)
    assert (got.by_device, got.basis) == ({"cpu": 3 * GIB}, "cap")


def test_a_gpu_instance_holds_its_device_memory_cap_else_its_fraction_of_the_device() -> None:
    capped = footprint(config(max_device_memory_bytes=6 * GIB), [GPU_HALF], sizes(), measured=GIB)
    assert (capped.by_device, capped.basis) == ({"cuda:0": 6 * GIB}, "cap")
    half = footprint(config(), [GPU_HALF], sizes(), measured=GIB)
    assert (half.by_device, half.basis) == ({"cuda:0": 40 * GIB}, "cap")


def test_a_declared_footprint_comes_first_and_a_measured_one_after_the_caps() -> None:
    declared = footprint(
        config(max_rss_bytes=3 * GIB, residency={"footprint_bytes": GIB}), [CPU], sizes(), measured=2 * GIB
    )
    assert (declared.by_device, declared.basis) == ({"cpu": GIB}, "declared")
    measured = footprint(config(), [CPU, CPU], sizes(), measured=2 * GIB)
    assert (measured.by_device, measured.basis) == ({"cpu": 4 * GIB}, "measured")
    assert footprint(config(), [CPU], sizes(), measured=None).basis == "unknown"
