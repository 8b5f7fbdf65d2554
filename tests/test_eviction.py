"""The choice of what to unload so that a model fits (`choose_victims`), alone: pure logic over declared
holders and budgets, so each rule is checked by its numbers. The daemon's use of it is in test_residency.py.
"""

from __future__ import annotations

from mpsd.daemon.core.residency.eviction import Holder, Shortfall, choose_victims
from mpsd.daemon.core.residency.footprint import Footprint

MIB = 2**20


def need(**by_device: int) -> Footprint:
    return Footprint({d.replace("_", ":"): n * MIB for d, n in by_device.items()}, "declared")


def holder(name: str, last_used: float, kept: str | None = None, **by_device: int) -> Holder:
    return Holder(name, need(**by_device), last_used, kept)


def names(chosen: list[Holder] | Shortfall) -> list[str]:
    assert isinstance(chosen, list), chosen
    return [h.name for h in chosen]


def test_the_least_recently_used_idle_holders_go_first_and_no_more_than_needed() -> None:
    """Room for three, all held: freeing exactly one model's room takes the oldest only; two, the two
    oldest in that order; the most recently used stays."""
    holders = [holder("new", 3.0, cpu=100), holder("old", 1.0, cpu=100), holder("mid", 2.0, cpu=100)]
    budgets: dict[str, int | None] = {"cpu": 300 * MIB}
    assert names(choose_victims(need(cpu=100), budgets, holders)) == ["old"]
    assert names(choose_victims(need(cpu=150), budgets, holders)) == ["old", "mid"]
    assert names(choose_victims(need(cpu=50), {"cpu": 400 * MIB}, holders)) == []  # it fits already


def test_pinned_busy_loading_and_young_holders_never_go() -> None:
    """The kept ones are the oldest here; only the idle one, used last of all, may go."""
    holders = [
        holder("pinned", 0.0, "pinned", cpu=100),
        holder("busy", 1.0, "in use", cpu=100),
        holder("young", 2.0, "loaded 3 s ago, min_residency_s 60", cpu=100),
        holder("idle", 9.0, cpu=100),
    ]
    assert names(choose_victims(need(cpu=100), {"cpu": 400 * MIB}, holders)) == ["idle"]


def test_a_shortfall_reports_what_could_be_freed_and_who_holds_the_rest() -> None:
    holders = [
        holder("pinned", 0.0, "pinned", cpu=100),
        holder("idle", 1.0, cpu=100),
        holder("busy", 2.0, "in use", cpu=100),
        holder("elsewhere", 0.5, cuda_0=100),  # another device: neither counted nor named
    ]
    chosen = choose_victims(need(cpu=250), {"cpu": 300 * MIB, "cuda:0": 100 * MIB}, holders)
    assert isinstance(chosen, Shortfall)
    assert (chosen.device, chosen.needed, chosen.budget, chosen.free) == (
        "cpu",
        250 * MIB,
        300 * MIB,
        100 * MIB,
    )
    assert [h.name for h in chosen.holders] == ["pinned", "idle", "busy"]
    assert chosen.message("m") == (
        "model 'm' needs 0.24 GiB on cpu; its budget is 0.29 GiB, of which 0.10 GiB can be freed or is free; "
        "held by: pinned (0.10 GiB, pinned), idle (0.10 GiB, idle), busy (0.10 GiB, in use)"
    )


def test_each_device_is_judged_by_its_own_budget_and_holders() -> None:
    """Room is made on the devices the model needs, from the models that hold memory there; a device with
    no budget, or a need of 0 bytes, asks for nothing."""
    holders = [
        holder("cpu_old", 0.0, cpu=100),
        holder("gpu_old", 1.0, cuda_0=100),
        holder("gpu_new", 2.0, cuda_0=100),
    ]
    budgets: dict[str, int | None] = {"cpu": 100 * MIB, "cuda:0": 200 * MIB, "cuda:1": None}
    assert names(choose_victims(need(cuda_0=100), budgets, holders)) == ["gpu_old"]
    assert names(choose_victims(need(cuda_1=10_000, cpu=0), budgets, holders)) == []


def test_a_holder_on_two_devices_is_chosen_once_and_frees_both() -> None:
    """Unloading it for the first device also frees its room on the second: nothing more goes there when
    that is enough, and when it is not, the next one there goes, not it again."""
    holders = [holder("both", 0.0, cpu=100, cuda_0=100), holder("gpu", 1.0, cuda_0=100)]
    budgets: dict[str, int | None] = {"cpu": 100 * MIB, "cuda:0": 200 * MIB}
    assert names(choose_victims(need(cpu=100, cuda_0=100), budgets, holders)) == ["both"]
    assert names(choose_victims(need(cpu=100, cuda_0=200), budgets, holders)) == ["both", "gpu"]
