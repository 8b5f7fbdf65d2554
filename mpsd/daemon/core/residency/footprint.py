"""How much of each device a model holds, and what the budget of each device is.

An instance's footprint is, in this order: what its config declares (`residency.footprint_bytes`); its cap
(`max_rss_bytes` on CPU; `max_device_memory_bytes`, or `memory_fraction` x the device's size, on a GPU);
what the same model version measured when it last ran (its workers' memory snapshots: RSS on CPU, the
allocator's reserved or driver-allocated bytes on a GPU); else 0, until it has run once.

On unified memory (Apple Silicon) the CPU and the GPU draw on the same RAM, so cpu and mps are one budget,
`cpu+mps`, and an MPS worker's own host memory (its RSS) counts beside what Metal allocated for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from mpsd import osfacts
from mpsd.config.daemon_config import DEFAULT_BUDGET, DaemonConfig
from mpsd.config.model_config import ModelConfig
from mpsd.daemon.supervise.device_memory import DeviceSizes
from mpsd.daemon.supervise.placement import InstancePlacement

# The snapshot counter that measures an instance on each kind of device.
MEASURED_BY = {"cpu": "rss_bytes", "cuda": "reserved_bytes", "mps": "driver_allocated_bytes"}
# The one budget of cpu and mps where they share the RAM.
UNIFIED = "cpu+mps"


def budget_key(device_key: str) -> str:
    """The budget a device's memory counts against: its own, but one for cpu and mps on unified memory."""
    if device_key in ("cpu", "mps") and osfacts.current().unified_memory:
        return UNIFIED
    return device_key


@dataclass(frozen=True)
class Footprint:
    by_device: dict[str, int]  # device key -> bytes
    basis: str  # declared, cap, measured, unknown (the weakest of its instances')

    def total(self) -> int:
        return sum(self.by_device.values())


def measure(device_key: str, snapshot: Mapping[str, int]) -> int | None:
    kind = device_key.partition(":")[0]
    value = int(snapshot.get(MEASURED_BY.get(kind, ""), 0))
    if kind == "mps" and osfacts.current().unified_memory:
        value += int(snapshot.get("rss_bytes", 0))  # the worker's host memory is the same RAM
    return value or None


def footprint(
    config: ModelConfig,
    placements: Iterable[InstancePlacement],
    sizes: DeviceSizes,
    measured: int | None,
) -> Footprint:
    """`measured` is the largest instance of this version seen running, in bytes on its device."""
    by_device: dict[str, int] = {}
    bases = set()
    for p in placements:
        key = p.device_key
        size = sizes.size(key)
        if config.residency.footprint_bytes is not None:
            nbytes, basis = config.residency.footprint_bytes, "declared"
        elif key == "cpu" and config.max_rss_bytes is not None:
            nbytes, basis = config.max_rss_bytes, "cap"
        elif key != "cpu" and config.max_device_memory_bytes is not None:
            nbytes, basis = config.max_device_memory_bytes, "cap"
        elif key != "cpu" and p.memory_fraction and size is not None:
            nbytes, basis = int(min(p.memory_fraction, 1.0) * size), "cap"
        elif measured:
            nbytes, basis = measured, "measured"
        else:
            nbytes, basis = 0, "unknown"
        pool = budget_key(key)
        by_device[pool] = by_device.get(pool, 0) + nbytes
        bases.add(basis)
    order = ("unknown", "measured", "cap", "declared")
    weakest = next((b for b in order if b in bases), "declared")
    return Footprint(by_device, weakest)


def budget_bytes(config: DaemonConfig, device_key: str, sizes: DeviceSizes) -> int | None:
    """The device's budget: `memory_budget_bytes` for it, else its share of the device; None while the
    device's size is unknown. The unified pool's is the larger of the cpu and mps budgets (the mps one
    once a worker has said how large the GPU's working set is), at most the RAM: never their sum."""
    if device_key in config.memory_budget_bytes:
        return config.memory_budget_bytes[device_key]
    if device_key == UNIFIED:
        parts = [budget_bytes(config, d, sizes) for d in ("cpu", "mps")]
        return min(max(b for b in parts if b is not None), sizes.size("cpu") or 0)
    kind = device_key.partition(":")[0]
    if kind not in DEFAULT_BUDGET:
        return None
    size = sizes.size(device_key)
    if size is None:
        return None
    share = config.memory_budget.get(kind, DEFAULT_BUDGET[kind])  # type: ignore[call-overload]
    return int(share * size)
