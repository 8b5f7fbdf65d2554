"""The Prometheus endpoint: metrics read from the registry at scrape time, served on the event loop.

Nothing is counted twice: the collector turns the statistics the daemon keeps anyway (VersionStats, the
instances' restarts, the workers' memory snapshots) into metric families when scraped, so inference pays
nothing for metrics. Serving from the event loop (prometheus_client's aiohttp handler, not its thread)
means a scrape never reads the registry while the loop is changing it. Names follow Triton's `nv_*`
metrics with an `mpsd_` prefix; counters carry prometheus_client's `_total` suffix.
"""

from __future__ import annotations

from collections.abc import Iterator

import structlog
from aiohttp import web
from prometheus_client import CollectorRegistry
from prometheus_client.aiohttp import make_aiohttp_handler
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from mpsd.daemon.api.residency_metrics import ResidencyCollector
from mpsd.daemon.api.sequence_metrics import sequence_metrics
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.registry import ModelState, Registry
from mpsd.daemon.dataplane.stats import LATENCY_BUCKETS_S, cumulative_buckets
from mpsd.daemon.supervise.fronts.pool import FrontPool

log = structlog.get_logger("mpsd.daemon.api.metrics")

VERSION_LABELS = ["model", "version"]
WORKER_LABELS = ["model", "version", "instance", "device"]
DISABLED = ("", "off")

# Worker memory counters per device type: (used, allocated, total) as the worker reports them.
_DEVICE_COUNTERS = {
    "cuda": ("reserved_bytes", "allocated_bytes", "total_bytes"),
    "mps": ("driver_allocated_bytes", "current_allocated_bytes", "recommended_max_bytes"),
}


def _us(ns: int) -> float:
    return ns / 1000.0


class RegistryCollector(Collector):
    """Builds every metric family from the registry's current state."""

    def __init__(self, registry: Registry) -> None:
        self.registry = registry

    def _versions(self) -> list[ModelVersion]:
        return [mv for entry in self.registry.entries.values() for mv in entry.versions.values()]

    def collect(self) -> Iterator[Metric]:
        versions = self._versions()
        yield from self._version_metrics(versions)
        yield from sequence_metrics(versions)
        yield from self._worker_metrics(versions)
        models = GaugeMetricFamily("mpsd_models", "Models the daemon knows (any state).")
        models.add_metric([], len(self.registry.entries))
        ready = GaugeMetricFamily("mpsd_models_ready", "Models with at least one version ready to serve.")
        ready.add_metric([], sum(e.state is ModelState.READY for e in self.registry.entries.values()))
        yield models
        yield ready

    def _version_metrics(self, versions: list[ModelVersion]) -> Iterator[Metric]:
        yield from _request_counters(versions)
        yield from _request_distributions(versions)
        yield from _version_gauges(versions)

    def _worker_metrics(self, versions: list[ModelVersion]) -> Iterator[Metric]:
        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=WORKER_LABELS)

        used = gauge("mpsd_gpu_memory_used_bytes", "Device memory the worker's allocator holds.")
        allocated = gauge("mpsd_gpu_memory_allocated_bytes", "Device memory in live tensors.")
        total = gauge("mpsd_gpu_memory_total_bytes", "Device memory the worker may use at most.")
        rss = gauge("mpsd_worker_rss_bytes", "Resident memory of the worker process.")
        up = gauge("mpsd_worker_up", "1 when the worker process is running and ready.")
        restarts = CounterMetricFamily(
            "mpsd_worker_restarts", "Times the worker was restarted after dying.", labels=WORKER_LABELS
        )
        in_place = CounterMetricFamily(
            "mpsd_worker_input_bytes_in_place",
            "Input bytes the current worker process took from front processes' shared memory itself, "
            "which the daemon did not copy.",
            labels=WORKER_LABELS,
        )
        for mv in versions:
            for instance in mv.instances:
                worker = instance.worker
                device_info = worker.ready.device if worker is not None and worker.ready else {}
                kind = str(device_info.get("kind", ""))
                index = device_info.get("index")
                device = f"{kind}:{index}" if kind and index is not None else kind
                labels = [mv.name, str(mv.version), str(instance.launch.instance), device]
                up.add_metric(labels, 1 if instance.ready else 0)
                restarts.add_metric(labels, instance.restarts)
                if worker is not None:
                    in_place.add_metric(labels, worker.channel.arenas.in_place_bytes)
                memory = worker.memory if worker is not None else {}
                if "rss_bytes" in memory:
                    rss.add_metric(labels, memory["rss_bytes"])
                keys = _DEVICE_COUNTERS.get(kind)
                if keys is None:
                    continue
                for family, key in zip((used, allocated, total), keys, strict=True):
                    if key in memory:
                        family.add_metric(labels, memory[key])
        yield from (used, allocated, total, rss, up, restarts, in_place)


def _request_counters(versions: list[ModelVersion]) -> Iterator[Metric]:
    """Requests, inferences, executions and responses counted per version, and the cumulative time spent
    in each stage of a request (Triton's nv_inference_* counters)."""

    def counter(name: str, doc: str) -> CounterMetricFamily:
        return CounterMetricFamily(name, doc, labels=VERSION_LABELS)

    success = counter("mpsd_inference_request_success", "Successful inference requests.")
    failure = CounterMetricFamily(
        "mpsd_inference_request_failure",
        "Failed inference requests, by error code.",
        labels=[*VERSION_LABELS, "reason"],
    )
    count = counter("mpsd_inference_count", "Inferences performed (a batch of N counts N).")
    execs = counter("mpsd_inference_exec_count", "Model executions (a batch counts once).")
    responses = counter(
        "mpsd_inference_responses", "Responses sent: one per request, each of a decoupled model's."
    )
    request_us = counter(
        "mpsd_inference_request_duration_us", "Cumulative end-to-end time of successful requests."
    )
    queue_us = counter("mpsd_inference_queue_duration_us", "Cumulative time requests waited in queue.")
    input_us = counter(
        "mpsd_inference_compute_input_duration_us", "Cumulative time preparing inputs (shared memory)."
    )
    infer_us = counter("mpsd_inference_compute_infer_duration_us", "Cumulative time running the model.")
    output_us = counter("mpsd_inference_compute_output_duration_us", "Cumulative time extracting outputs.")
    for mv in versions:
        labels = [mv.name, str(mv.version)]
        s = mv.stats
        success.add_metric(labels, s.success.count)
        for reason, n in sorted(s.failures_by_reason.items()):
            failure.add_metric([*labels, reason], n)
        count.add_metric(labels, s.inference_count)
        execs.add_metric(labels, s.execution_count)
        responses.add_metric(labels, s.responses)
        request_us.add_metric(labels, _us(s.success.ns))
        queue_us.add_metric(labels, _us(s.queue.ns))
        input_us.add_metric(labels, _us(s.compute_input.ns))
        infer_us.add_metric(labels, _us(s.compute_infer.ns))
        output_us.add_metric(labels, _us(s.compute_output.ns))
    yield from (
        success,
        failure,
        count,
        execs,
        responses,
        request_us,
        queue_us,
        input_us,
        infer_us,
        output_us,
    )


def _request_distributions(versions: list[ModelVersion]) -> Iterator[Metric]:
    """How times and batch sizes are spread: the device's compute time and the request latency as
    histograms, and executions by batch size."""
    device = HistogramMetricFamily(
        "mpsd_inference_device_compute_seconds",
        "The device's own compute time per execution (timing events on CUDA and MPS; none on the CPU).",
        labels=VERSION_LABELS,
    )
    latency = HistogramMetricFamily(
        "mpsd_inference_request_duration_seconds",
        "End-to-end time of successful requests (the same requests as request_duration_us).",
        labels=VERSION_LABELS,
    )
    batches = CounterMetricFamily(
        "mpsd_inference_batch_executions",
        "Model executions by the batch size they ran (rows of every request in the batch).",
        labels=[*VERSION_LABELS, "batch_size"],
    )
    for mv in versions:
        labels = [mv.name, str(mv.version)]
        s = mv.stats
        if s.device_compute.count:
            device.add_metric(labels, s.device_compute.cumulative(), s.device_compute.ns / 1e9)
        latency.add_metric(
            labels, cumulative_buckets(LATENCY_BUCKETS_S, s.latency_buckets), s.success.ns / 1e9
        )
        for size, b in sorted(s.batches.items()):
            batches.add_metric([*labels, str(size)], b.compute_infer.count)
    yield from (device, latency, batches)


def _version_gauges(versions: list[ModelVersion]) -> Iterator[Metric]:
    """Each version's state now: requests in progress, whether it can serve, how long it took to load."""
    pending = GaugeMetricFamily(
        "mpsd_inference_pending_request_count",
        "Requests queued or running now.",
        labels=VERSION_LABELS,
    )
    ready = GaugeMetricFamily("mpsd_model_ready", "1 when the version can serve.", labels=VERSION_LABELS)
    load = GaugeMetricFamily(
        "mpsd_model_load_duration_secs",
        "How long loading and warming up the version took.",
        labels=VERSION_LABELS,
    )
    for mv in versions:
        labels = [mv.name, str(mv.version)]
        pending.add_metric(labels, mv.inflight)
        ready.add_metric(labels, 1 if mv.ready else 0)
        if mv.load_duration_s is not None:
            load.add_metric(labels, mv.load_duration_s)
    yield from (pending, ready, load)


class FrontCollector(Collector):
    """The front processes: how many run, and what each has handed to the daemon."""

    def __init__(self, pool: FrontPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        running = GaugeMetricFamily("mpsd_front_processes", "gRPC front processes running.")
        running.add_metric([], self.pool.running())
        served = CounterMetricFamily(
            "mpsd_front_requests", "ModelInfer calls a front process handed to the daemon.", labels=["front"]
        )
        restarts = CounterMetricFamily(
            "mpsd_front_restarts", "Times a front process died and was started again.", labels=["front"]
        )
        arena = CounterMetricFamily(
            "mpsd_front_arena_transfers",
            "Large ModelInfer requests and replies that went between a front and the daemon through shared "
            "memory instead of their socket.",
            labels=["front", "direction"],
        )
        split = CounterMetricFamily(
            "mpsd_front_split_requests",
            "ModelInfer calls a front cut apart itself (the request's key declared once, then where its id "
            "and tensor bytes are), so that the daemon did not walk the message.",
            labels=["front"],
        )
        for index in sorted(self.pool.fronts):
            counts = self.pool.counts[index]
            served.add_metric([str(index)], counts.served)
            split.add_metric([str(index)], counts.split)
            restarts.add_metric([str(index)], self.pool.restarts.get(index, 0))
            arena.add_metric([str(index), "request"], counts.arena_requests)
            arena.add_metric([str(index), "reply"], counts.arena_replies)
        yield running
        yield served
        yield restarts
        yield arena
        yield split


def parse_address(address: str) -> tuple[str, int]:
    """`host:port`, `[v6]:port` or `:port` (all interfaces) into a host and a port to listen on."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"metrics address '{address}' is not host:port")
    return host.strip("[]") or "0.0.0.0", int(port)


class MetricsEndpoint:
    """GET /metrics through prometheus_client's aiohttp handler, on the daemon's event loop; "" or "off"
    disables it."""

    def __init__(self, address: str | None, registry: Registry) -> None:
        self.address = None if address is None or address.strip().lower() in DISABLED else address
        self.prometheus = CollectorRegistry(auto_describe=False)
        self.prometheus.register(RegistryCollector(registry))
        self.prometheus.register(ResidencyCollector(registry))
        self._runner: web.AppRunner | None = None

    def add_fronts(self, pool: FrontPool) -> None:
        self.prometheus.register(FrontCollector(pool))

    def add_collector(self, collector: Collector) -> None:
        """Metrics an adapter keeps itself (OpenAI's requests), built when scraped like the rest."""
        self.prometheus.register(collector)

    def app(self) -> web.Application:
        app = web.Application()
        scrape = make_aiohttp_handler(self.prometheus)
        app.router.add_get("/metrics", scrape)
        app.router.add_get("/metrics/", scrape)
        app.router.add_get("/", _index)
        return app

    async def start(self) -> None:
        """Listen; a busy port is logged, not fatal: inference matters more than metrics."""
        if self.address is None:
            return
        runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        try:
            host, port = parse_address(self.address)
            await web.TCPSite(runner, host, port).start()
        except (OSError, ValueError) as exc:
            await runner.cleanup()
            log.error("metrics endpoint not started", address=self.address, reason=str(exc))
            return
        self._runner = runner
        log.info("metrics endpoint listening", url=f"http://{self.address}/metrics")

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def _index(request: web.Request) -> web.Response:
    return web.Response(text="mpsd: metrics at /metrics\n")
