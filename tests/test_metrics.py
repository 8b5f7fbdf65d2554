"""The Prometheus endpoint of a real daemon, scraped over HTTP: the counters move with the requests."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families
from tritonclient.utils import InferenceServerException

from mpsd.config.daemon_config import DaemonConfig
from mpsd.daemon.api.device_stats import DEVICE_COMPUTE_KEY
from mpsd.daemon.api.metrics import MetricsEndpoint, parse_address
from mpsd.daemon.dataplane.stats import LATENCY_BUCKETS_S, VersionStats, cumulative_buckets
from tests import models
from tests.conftest import RunningDaemon, free_port, http_request, serving, wait_for

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("repo")
    # On the CPU wherever the tests run: the checks below name the device and expect no GPU metrics.
    models.add_sub(repo, dims=4, instance_group=[{"kind": "KIND_CPU", "count": 1}])
    models.python_model(
        repo,
        "raiser",
        "if float(inputs['x'].sum()) > 0:\n    raise ValueError('no')\nreturn {'y': inputs['x']}",
        instance_group=[{"kind": "KIND_CPU", "count": 1}],
    )
    d = RunningDaemon(
        repo,
        tmp_path_factory.mktemp("log") / "daemon.log",
        extra_args=["--metrics-address", f"127.0.0.1:{free_port()}"],
    )
    try:
        d.wait_ready()
        # A port someone else holds is logged, not fatal; say so here instead of failing on the scrape.
        assert "metrics endpoint listening" in d.log(), d.log()
        yield d
    finally:
        d.stop()
        d.kill_group()


def metrics_url(daemon: RunningDaemon) -> str:
    args = daemon.proc.args
    assert isinstance(args, list)
    return f"http://{args[args.index('--metrics-address') + 1]}/metrics"


def scrape(daemon: RunningDaemon) -> Samples:
    with urllib.request.urlopen(metrics_url(daemon), timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def add_sub_inputs(batch: int) -> list[grpcclient.InferInput]:
    inputs = []
    for name in ("INPUT0", "INPUT1"):
        inp = grpcclient.InferInput(name, [batch, 4], "FP32")
        inp.set_data_from_numpy(np.ones((batch, 4), np.float32))
        inputs.append(inp)
    return inputs


def test_counters_move_with_requests(daemon: RunningDaemon) -> None:
    model = {"model": "add_sub", "version": "1"}
    before = scrape(daemon)
    assert value(before, "mpsd_model_ready", **model) == 1
    assert value(before, "mpsd_model_load_duration_secs", **model) > 0
    for _ in range(3):
        daemon.client.infer("add_sub", add_sub_inputs(batch=2))
    after = scrape(daemon)

    def moved(name: str) -> float:
        return value(after, name, **model) - value(before, name, **model)

    assert moved("mpsd_inference_request_success_total") == 3
    assert moved("mpsd_inference_count_total") == 6  # a batch of 2 counts 2
    assert moved("mpsd_inference_exec_count_total") == 3
    assert moved("mpsd_inference_request_duration_us_total") > 0
    assert moved("mpsd_inference_compute_infer_duration_us_total") > 0
    # Each request waits in the queue for a task switch at least: the time is counted, and is part of the
    # request's own duration.
    assert (
        0
        < moved("mpsd_inference_queue_duration_us_total")
        < moved("mpsd_inference_request_duration_us_total")
    )
    assert value(after, "mpsd_inference_pending_request_count", **model) == 0
    assert value(after, "mpsd_models_ready") == 2
    # The same requests in the latency histogram: its count and sum are the success counter's.
    assert moved("mpsd_inference_request_duration_seconds_count") == 3
    assert moved("mpsd_inference_request_duration_seconds_sum") * 1e6 == pytest.approx(
        moved("mpsd_inference_request_duration_us_total")
    )
    buckets = sorted(
        (float(dict(labels)["le"]), n)
        for (name, labels), n in after.items()
        if name == "mpsd_inference_request_duration_seconds_bucket" and ("model", "add_sub") in labels
    )
    assert buckets[-1] == (
        float("inf"),
        value(after, "mpsd_inference_request_duration_seconds_count", **model),
    )
    assert [n for _, n in buckets] == sorted(n for _, n in buckets)  # cumulative
    batch = {**model, "batch_size": "2"}
    assert (
        value(after, "mpsd_inference_batch_executions_total", **batch)
        - value(before, "mpsd_inference_batch_executions_total", **batch)
        == 3
    )


def test_every_success_is_in_the_latency_histogram() -> None:
    """Answered by the model or from the response cache, each success counts in one latency bucket, so the
    histogram's count is the success counter's."""
    stats = VersionStats()
    stats.record_success(3_000_000, 2)
    stats.record_cache_hit(1_000, 40_000)
    stats.record_failure(1_000, "INTERNAL")
    assert sum(stats.latency_buckets) == stats.success.count == 2
    cumulative = dict(cumulative_buckets(LATENCY_BUCKETS_S, stats.latency_buckets))
    assert cumulative["5e-05"] == 1 and cumulative["0.002"] == 1 and cumulative["0.005"] == 2


def test_no_device_time_on_the_cpu(daemon: RunningDaemon) -> None:
    """The CPU has no device time: absent from the HTTP statistics, the histogram and `mpsd status`, not
    reported as zero."""
    daemon.client.infer("add_sub", add_sub_inputs(batch=1))
    status, stats, _ = http_request(daemon.http_address, "GET", "/v2/models/add_sub/stats")
    assert status == 200
    (entry,) = stats["model_stats"]
    assert entry["execution_count"] >= 1 and entry["inference_stats"]["compute_infer"]["ns"] > 0
    assert DEVICE_COMPUTE_KEY not in entry["inference_stats"], entry
    assert all(DEVICE_COMPUTE_KEY not in b for b in entry["batch_stats"]), entry
    with urllib.request.urlopen(metrics_url(daemon), timeout=10) as response:
        text = response.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["mpsd_inference_device_compute_seconds"].samples == []
    assert 'model="add_sub"' in text  # the other families do have it
    shown = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--json", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(shown.stdout)["device_compute"] == []
    text_status = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--address", daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "add_sub" in text_status and "DEVICE TIME" not in text_status


def test_failures_are_counted_by_reason(daemon: RunningDaemon) -> None:
    labels = {"model": "raiser", "version": "1", "reason": "INTERNAL"}
    before = value(scrape(daemon), "mpsd_inference_request_failure_total", **labels)
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.ones(2, np.float32))
    with pytest.raises(InferenceServerException):
        daemon.client.infer("raiser", [inp])
    assert value(scrape(daemon), "mpsd_inference_request_failure_total", **labels) == before + 1


def test_worker_memory_and_restarts_per_worker(daemon: RunningDaemon) -> None:
    samples = scrape(daemon)
    worker = {"model": "add_sub", "version": "1", "instance": "0", "device": "cpu"}
    assert value(samples, "mpsd_worker_up", **worker) == 1
    assert value(samples, "mpsd_worker_restarts_total", **worker) == 0
    assert value(samples, "mpsd_worker_rss_bytes", **worker) > 10 * 2**20  # a process with torch loaded
    assert not any(name.startswith("mpsd_gpu_memory") for name, _ in samples)  # CPU workers have none


def test_served_by_prometheus_clients_exposition(daemon: RunningDaemon) -> None:
    """Content negotiation as prometheus_client does it: OpenMetrics when asked for, gzip when accepted."""
    import gzip

    request = urllib.request.Request(
        metrics_url(daemon),
        headers={"Accept": "application/openmetrics-text; version=1.0.0", "Accept-Encoding": "gzip"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        assert response.headers["Content-Encoding"] == "gzip"
        text = gzip.decompress(response.read()).decode()
    assert text.rstrip().endswith("# EOF")
    assert "mpsd_inference_request_success_total" in text


def test_other_paths_are_not_found(daemon: RunningDaemon) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(metrics_url(daemon).replace("/metrics", "/nope"), timeout=10)
    assert err.value.code == 404
    err.value.close()


def test_address_settings() -> None:
    assert DaemonConfig().metrics_address == "127.0.0.1:8002"
    assert parse_address("[::1]:9000") == ("::1", 9000)
    assert parse_address(":9000") == ("0.0.0.0", 9000)
    with pytest.raises(ValueError):
        parse_address("localhost")
    for off in ("", "off", None):
        assert MetricsEndpoint(off, None).address is None  # type: ignore[arg-type]


def test_metrics_off_in_the_config_file_and_a_port_in_use_leave_the_daemon_serving(
    start_daemon, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """`metrics_address: off` as written in YAML (which reads a bare off as false) disables the endpoint;
    a metrics port some other process holds is logged and the daemon serves without metrics."""
    repo = tmp_path / "repo"
    repo.mkdir()
    config = tmp_path / "mpsd.yaml"
    config.write_text("metrics_address: off\n")
    off = start_daemon(repo, config=config)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = start_daemon(repo, extra_args=["--metrics-address", f"127.0.0.1:{port}"])
        for daemon in (off, busy):
            daemon.wait_ready()
        wait_for(lambda: "metrics endpoint not started" in busy.log(), 30, "the busy port logged")
    assert "metrics endpoint listening" not in off.log()
    assert "metrics endpoint listening" not in busy.log()
    assert off.client.is_server_live() and busy.client.is_server_live()


class HoldsDeviceMemory(torch.nn.Module):
    """Keeps 64 MiB in a buffer on its device, so the worker's allocator has a known floor."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("ballast", torch.zeros(16 * 2**20))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ballast[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_gauges_per_worker(tmp_path: Path) -> None:
    """A CUDA worker reports its allocator's figures: at least the 64 MiB its model holds, reserved at
    least what is allocated, and the device's total memory."""
    repo = tmp_path / "repo"
    models.save_torchscript(HoldsDeviceMemory(), repo / "ballast" / "1" / "model.pt")
    models.write_config(
        repo / "ballast",
        {
            "backend": "torchscript",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
            "instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0]}],
        },
    )
    address = f"127.0.0.1:{free_port()}"
    with serving(repo, tmp_path / "daemon.log", extra_args=["--metrics-address", address]) as daemon:
        inp = grpcclient.InferInput("x", [4], "FP32")
        inp.set_data_from_numpy(np.ones(4, np.float32))
        daemon.client.infer("ballast", [inp])
        worker = {"model": "ballast", "version": "1", "instance": "0", "device": "cuda:0"}

        def gauges() -> Samples | None:
            samples = scrape(daemon)
            has = value(samples, "mpsd_gpu_memory_allocated_bytes", **worker) > 0
            return samples if has else None

        samples = wait_for(gauges, 60, "GPU memory gauges")
    allocated = value(samples, "mpsd_gpu_memory_allocated_bytes", **worker)
    assert allocated >= 64 * 2**20
    assert value(samples, "mpsd_gpu_memory_used_bytes", **worker) >= allocated
    assert (
        value(samples, "mpsd_gpu_memory_total_bytes", **worker)
        == torch.cuda.get_device_properties(0).total_memory
    )
