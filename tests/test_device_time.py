"""The device's own compute time per execution: the worker's timing events (with stand-ins where no GPU
runs them), the statistics, metrics and status built from it, and, where torch sees a CUDA GPU, the real
daemon's figures (tests marked so skip elsewhere)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from prometheus_client.parser import text_string_to_metric_families

from mpsd.daemon.api.device_stats import DEVICE_COMPUTE_KEY, with_device_compute
from mpsd.daemon.dataplane.stats import DEVICE_BUCKETS_S, VersionStats
from mpsd.ipc.protocol import ModelSpec, TensorRef, TensorSpec
from mpsd.ipc.shm import Region
from mpsd.tools.ops import render_status
from mpsd.worker.device import execution_timer
from mpsd.worker.device_time import ExecutionTimer, timing_events
from mpsd.worker.inference import Runner
from tests import models
from tests.conftest import RunningDaemon, free_port

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


class StandInMpsEvent:
    """Stands in for torch.mps.event.Event, which only runs on a Mac with Metal: the same signature
    (`enable_timing=False`), `record()` without arguments (MPS records on its default stream),
    `synchronize()`, and `elapsed_time(end_event)` in milliseconds. Each record() takes the next time from
    a script, so the elapsed time is known."""

    made: list[StandInMpsEvent] = []
    clock_ms = iter([10.0, 12.5, 20.0, 20.25])

    def __init__(self, enable_timing: bool = False) -> None:
        self.enable_timing = enable_timing
        self.recorded_ms: float | None = None
        self.synchronized = False
        StandInMpsEvent.made.append(self)

    def record(self) -> None:
        self.recorded_ms = next(StandInMpsEvent.clock_ms)

    def synchronize(self) -> None:
        self.synchronized = True

    def elapsed_time(self, end_event: StandInMpsEvent) -> float:
        assert self.enable_timing and end_event.enable_timing, "MPS refuses events made without timing"
        assert self.recorded_ms is not None and end_event.recorded_ms is not None
        return end_event.recorded_ms - self.recorded_ms


def test_mps_timing_events_follow_the_mps_event_api(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.mps.event, "Event", StandInMpsEvent)
    monkeypatch.setattr(StandInMpsEvent, "made", [])
    monkeypatch.setattr(StandInMpsEvent, "clock_ms", iter([10.0, 12.5, 20.0, 20.25]))
    new_event = timing_events("mps")
    assert new_event is not None
    timer = ExecutionTimer(new_event)
    assert [e.enable_timing for e in StandInMpsEvent.made] == [True, True]
    timer.start()
    timer.stop()
    assert timer.elapsed_ns() == 2_500_000  # 2.5 ms
    timer.start()  # the same two events, recorded again for the next execution
    timer.stop()
    assert timer.elapsed_ns() == 250_000
    assert len(StandInMpsEvent.made) == 2


def test_cuda_timing_events_are_cuda_events_with_timing() -> None:
    new_event = timing_events("cuda")
    assert new_event is not None
    if HAS_CUDA:
        event = new_event()
        assert isinstance(event, torch.cuda.Event)
    assert timing_events("cpu") is None


class StandInTimer:
    """Stands in for a GPU's timing events around the model call: counts its calls, answers 1.5 ms."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def start(self) -> None:
        self.calls.append("start")

    def stop(self) -> None:
        self.calls.append("stop")

    def elapsed_ns(self) -> int:
        self.calls.append("elapsed")
        return 1_500_000


def identity_runner() -> tuple[Runner, Region, list[TensorRef]]:
    spec = ModelSpec(
        "m", 1, "python", "", 0, (TensorSpec("x", "FP32", (4,)),), (TensorSpec("y", "FP32", (4,)),)
    )
    runner = Runner(spec, lambda inputs: {"y": inputs[0] * 2}, torch.device("cpu"))
    region = SimpleNamespace(buf=memoryview(bytearray(np.arange(4, dtype=np.float32).tobytes())))
    return runner, region, [TensorRef("x", "FP32", (4,), 0, 16)]  # type: ignore[return-value]


def test_the_cpu_has_no_device_time() -> None:
    assert execution_timer(torch.device("cpu")) is None
    runner, region, refs = identity_runner()
    outputs, _, _, device_ns = runner.finish(runner.launch(region, refs, {}))
    assert device_ns is None
    assert outputs["y"].tolist() == [0.0, 2.0, 4.0, 6.0]


def test_the_runner_reads_its_timer_around_the_model_call() -> None:
    runner, region, refs = identity_runner()
    timer = StandInTimer()
    runner._timers = (timer, timer)  # type: ignore[assignment]
    order: list[str] = []
    runner.backend = lambda inputs: (order.extend(timer.calls), {"y": inputs[0]})[1]  # type: ignore[assignment]
    _, _, infer_ns, device_ns = runner.finish(runner.launch(region, refs, {}))
    assert device_ns == 1_500_000 and infer_ns > 0
    assert order == ["start"], "started before the model call"
    assert timer.calls == ["start", "stop", "elapsed"]


def test_device_time_feeds_statistics_json_and_histogram() -> None:
    stats = VersionStats()
    stats.record_execution(4, 10, 2_000_000, 10, 2, device_ns=1_000_000)
    stats.record_execution(4, 10, 3_000_000, 10, 1, device_ns=3_000_000)
    stats.record_execution(1, 10, 1_000_000, 10, 1)  # on the CPU: none
    assert (stats.device_compute.count, stats.device_compute.ns) == (2, 4_000_000)
    cumulative = dict(stats.device_compute.cumulative())
    assert cumulative["0.001"] == 1 and cumulative["0.0025"] == 1 and cumulative["0.005"] == 2
    assert cumulative["+Inf"] == 2 and len(cumulative) == len(DEVICE_BUCKETS_S) + 1
    body = {"model_stats": [{"inference_stats": {}, "batch_stats": [{"batch_size": 1}, {"batch_size": 4}]}]}
    with_device_compute(body, [stats])
    entry = body["model_stats"][0]
    assert entry["inference_stats"][DEVICE_COMPUTE_KEY] == {"count": 2, "ns": 4_000_000}
    assert DEVICE_COMPUTE_KEY not in entry["batch_stats"][0]
    assert entry["batch_stats"][1][DEVICE_COMPUTE_KEY] == {"count": 2, "ns": 4_000_000}
    none = {"model_stats": [{"inference_stats": {}, "batch_stats": [{"batch_size": 1}]}]}
    with_device_compute(none, [VersionStats()])
    assert none["model_stats"][0] == {"inference_stats": {}, "batch_stats": [{"batch_size": 1}]}


def test_status_shows_device_time_only_where_there_is_some() -> None:
    data: dict[str, Any] = {"address": "a", "models": [], "workers": [], "fronts": [], "device_compute": []}
    assert "DEVICE TIME" not in render_status(data)
    data["device_compute"] = [{"model": "m", "version": 1, "executions": 4, "ns": 10_000_000}]
    text = render_status(data)
    assert "DEVICE TIME / EXECUTION" in text and "2.500 ms" in text


# ---- on a CUDA GPU: the real daemon ---------------------------------------------------------------------


class MatMuls(torch.nn.Module):
    """Enough GPU work per call that the device's time is well above the events' resolution."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x
        for _ in range(8):
            y = torch.tanh(y @ y.transpose(-1, -2)) @ y
        return y


@pytest.fixture(scope="module")
def gpu_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU")
    repo = tmp_path_factory.mktemp("repo")
    models.save_torchscript(MatMuls(), repo / "matmuls" / "1" / "model.pt")
    models.write_config(
        repo / "matmuls",
        {
            "backend": "torchscript",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [512, 512]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [512, 512]}],
            "instance_group": [{"kind": "KIND_GPU", "count": 1}],
        },
    )
    d = RunningDaemon(
        repo,
        tmp_path_factory.mktemp("log") / "daemon.log",
        extra_args=["--metrics-address", f"127.0.0.1:{free_port()}"],
    )
    try:
        d.wait_ready()
        yield d
    finally:
        d.stop()
        d.kill_group()


def histogram_count(daemon: RunningDaemon) -> float:
    args = daemon.proc.args
    assert isinstance(args, list)
    url = f"http://{args[args.index('--metrics-address') + 1]}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "mpsd_inference_device_compute_seconds_count" and s.labels.get("model") == "matmuls"
    )


def http_stats(daemon: RunningDaemon) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{daemon.http_address}/v2/models/matmuls/stats", timeout=10) as r:
        return json.loads(r.read())["model_stats"][0]  # type: ignore[no-any-return]


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_time_is_reported_and_within_the_host_time(gpu_daemon: RunningDaemon) -> None:
    before_count = histogram_count(gpu_daemon)
    before = http_stats(gpu_daemon)
    executions = 5
    x = grpcclient.InferInput("x", [512, 512], "FP32")
    x.set_data_from_numpy(np.random.default_rng(0).standard_normal((512, 512), dtype=np.float32) / 32)
    for _ in range(executions):
        gpu_daemon.client.infer("matmuls", [x])
    after = http_stats(gpu_daemon)
    device = after["inference_stats"][DEVICE_COMPUTE_KEY]
    device_before = before["inference_stats"].get(DEVICE_COMPUTE_KEY, {"count": 0, "ns": 0})
    assert device["count"] - device_before["count"] == executions
    device_ns = device["ns"] - device_before["ns"]
    host_ns = (
        after["inference_stats"]["compute_infer"]["ns"] - before["inference_stats"]["compute_infer"]["ns"]
    )
    assert 0 < device_ns <= host_ns + 1_000_000 * executions, (device_ns, host_ns)  # 1 ms each to spare
    assert histogram_count(gpu_daemon) - before_count == executions
    shown = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--json", "--address", gpu_daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    (entry,) = json.loads(shown.stdout)["device_compute"]
    assert entry["model"] == "matmuls" and entry["executions"] >= executions and entry["ns"] > 0
