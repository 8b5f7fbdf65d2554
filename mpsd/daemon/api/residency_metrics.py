"""Metrics of model residency: each device's budget and what is held of it, loads on demand, idle unloads
and evictions, and the time requests waited for loads. Read from the registry's residency at scrape time,
like every other metric."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric, SummaryMetricFamily
from prometheus_client.registry import Collector

from mpsd.daemon.core.registry import Registry


class ResidencyCollector(Collector):
    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        residency = self.registry.residency
        budget = GaugeMetricFamily(
            "mpsd_memory_budget_bytes", "Memory loaded models may hold on each device.", labels=["device"]
        )
        for device, nbytes in residency.budgets().items():
            if nbytes is not None:
                budget.add_metric([device], nbytes)
        held = GaugeMetricFamily(
            "mpsd_memory_resident_bytes",
            "Footprints of the models loaded or loading on each device.",
            labels=["device"],
        )
        for device, nbytes in residency.resident_bytes().items():
            held.add_metric([device], nbytes)
        resident = GaugeMetricFamily(
            "mpsd_model_resident",
            "1 while the model runs, 0 while it is known but not loaded.",
            labels=["model"],
        )
        for name, entry in self.registry.entries.items():
            resident.add_metric([name], 1 if entry.versions else 0)
        stats = residency.stats
        loads = CounterMetricFamily(
            "mpsd_model_loads_on_demand",
            "Loads started by a request for a model not loaded.",
            labels=["model"],
        )
        for name, count in stats.loads_on_demand.items():
            loads.add_metric([name], count)
        unloads = CounterMetricFamily(
            "mpsd_model_unloads",
            "Models unloaded to free memory: after their keep-alive (idle) or for another model (evicted).",
            labels=["model", "reason"],
        )
        for (name, reason), count in stats.unloads.items():
            unloads.add_metric([name, reason], count)
        waited = SummaryMetricFamily(
            "mpsd_model_load_wait_seconds", "Time requests waited for their model to load.", labels=["model"]
        )
        for name, (total, waits) in stats.load_wait_s.items():
            waited.add_metric([name], count_value=int(waits), sum_value=total)
        yield from (budget, held, resident, loads, unloads, waited)
