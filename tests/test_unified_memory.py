"""On unified memory (Apple Silicon, macOS's facts in force) the CPU and the GPU share the RAM: a model on cpu
and one on mps count against one budget, so loading the second evicts the first when together they exceed
it, where separate budgets let both stay. No Mac here: the RAM and Metal's working set are given, and the
versions the admission places are stood in (no worker can run on MPS here); the admission is the real one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import structlog

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.config.repository import load_model_source
from mpsd.daemon.core.residency.footprint import UNIFIED, measure
from mpsd.daemon.core.residency.manager import NOT_LOADED_YET, Residency
from mpsd.daemon.core.rollout import ModelEntry
from mpsd.daemon.supervise.device_memory import DeviceSizes
from mpsd.daemon.supervise.launch import plan_version
from mpsd.errors import ResourceExhausted
from tests import models

GIB = 2**30
RAM = 64 * GIB
WORKING_SET = 48 * GIB  # Metal's recommended working set: about 75% of the RAM


def declared(repo: Path, name: str, kind: str, footprint: int) -> None:
    models.python_model(
        repo,
        name,
        "return {'y': inputs['x'] + 1}",
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "instance_group": [{"kind": kind}],
            "residency": {"load": "on_demand", "footprint_bytes": footprint},
        },
    )


def loaded_version(source: Any) -> Any:
    """What admission reads of a running version: its config, placements and whether it is busy."""

    async def unload(_timeout: float) -> None:
        return None

    placements, _ = plan_version(source, 1)
    return SimpleNamespace(
        config=source.config,
        placements=placements,
        placements_in_use=lambda: placements,
        label=f"{source.name}/1",
        fingerprint=source.fingerprint,
        instances=[],
        inflight=0,
        plane=SimpleNamespace(holding=False),
        unload=unload,
    )


def load_both(repo: Path) -> dict[str, ModelEntry]:
    """A 20 GiB model on cpu, then a 30 GiB one on mps; cpu's budget is 0.5 x 64 GiB, mps's 0.8 x 48 GiB."""
    declared(repo, "on_cpu", "KIND_CPU", 20 * GIB)
    declared(repo, "on_mps", "KIND_MPS", 30 * GIB)
    entries = {
        name: ModelEntry(name, source=load_model_source(repo / name), cold_reason=NOT_LOADED_YET)
        for name in ("on_cpu", "on_mps")
    }

    async def apply(source: Any) -> bool:
        entry = entries[source.name]
        entry.versions, entry.loading = {1: loaded_version(source)}, False  # as the rollout leaves it
        return True

    async def scenario() -> None:
        config = DaemonConfig.model_validate({"residency": {"min_residency_s": 0}})
        residency = Residency(config, entries, apply, lambda _n: asyncio.Lock(), lambda: 1.0)
        residency.sizes = DeviceSizes(ram_bytes=lambda: RAM)
        residency.sizes.learn("mps", {"recommended_max_bytes": WORKING_SET})
        for name in ("on_cpu", "on_mps"):
            source = entries[name].source
            assert source is not None
            await residency.load(entries[name], source, "test")

    asyncio.run(scenario())
    return entries


def test_separate_memory_keeps_a_cpu_and_an_mps_model_side_by_side(tmp_path: Path) -> None:
    with osfacts.use(osfacts.LINUX):
        entries = load_both(tmp_path / "repo")
    assert entries["on_cpu"].versions and entries["on_mps"].versions


def test_unified_memory_evicts_the_cpu_model_when_both_exceed_the_one_pool(tmp_path: Path) -> None:
    """20 + 30 GiB exceed the pool's budget, the larger of the two (0.8 x 48 = 38.4 GiB), not their sum."""
    with osfacts.use(osfacts.DARWIN):
        entries = load_both(tmp_path / "repo")
    assert entries["on_mps"].versions
    assert not entries["on_cpu"].versions
    assert entries["on_cpu"].cold_reason == "evicted for 'on_mps'"


def test_unified_memory_budgets_cpu_and_mps_as_one_pool_of_the_ram() -> None:
    async def nothing(_source: Any) -> bool:
        return True

    with osfacts.use(osfacts.DARWIN):
        residency = Residency(DaemonConfig(), {}, nothing, lambda _n: asyncio.Lock(), lambda: 1.0)
        residency.sizes = DeviceSizes(ram_bytes=lambda: RAM)
        assert residency.budgets() == {UNIFIED: RAM // 2}  # the cpu share until the GPU's size is known
        residency.sizes.learn("mps", {"recommended_max_bytes": WORKING_SET})
        assert residency.budgets() == {UNIFIED: int(0.8 * WORKING_SET)}


def test_an_mps_workers_host_memory_counts_on_unified_memory() -> None:
    snapshot = {"driver_allocated_bytes": 3 * GIB, "rss_bytes": 2 * GIB}
    with osfacts.use(osfacts.LINUX):
        assert measure("mps", snapshot) == 3 * GIB
    with osfacts.use(osfacts.DARWIN):
        assert measure("mps", snapshot) == 5 * GIB
        assert measure("cpu", snapshot) == 2 * GIB


def test_the_residency_events_name_an_eviction_and_a_model_that_does_not_fit(tmp_path: Path) -> None:
    """docs/memory.md's events: `model unloaded` with its reason and `unload_kind` (evicted here), and `model
    does not fit the memory budget` with the figures a refused load reports."""
    with osfacts.use(osfacts.DARWIN), structlog.testing.capture_logs() as logged:
        load_both(tmp_path / "repo")
    [unloaded] = [e for e in logged if e["event"] == "model unloaded"]
    assert (unloaded["model"], unloaded["unload_kind"]) == ("on_cpu", "evicted")
    assert unloaded["reason"] == "evicted for 'on_mps'" and unloaded["event_kind"] == "residency"

    declared(tmp_path / "repo", "huge", "KIND_CPU", 2 * RAM)
    entry = ModelEntry(
        "huge", source=load_model_source(tmp_path / "repo" / "huge"), cold_reason=NOT_LOADED_YET
    )

    async def never(_source: Any) -> bool:
        raise AssertionError("a model that does not fit is not placed")

    async def scenario() -> None:
        residency = Residency(DaemonConfig(), {"huge": entry}, never, lambda _n: asyncio.Lock(), lambda: 1.0)
        residency.sizes = DeviceSizes(ram_bytes=lambda: RAM)
        assert entry.source is not None
        with pytest.raises(ResourceExhausted) as refused:
            await residency.load(entry, entry.source, "test")
        [event] = [e for e in logged if e["event"] == "model does not fit the memory budget"]
        assert event["model"] == "huge" and event["reason"] == refused.value.message
        assert "huge" in event["reason"]

    with osfacts.use(osfacts.LINUX), structlog.testing.capture_logs() as logged:
        asyncio.run(scenario())
