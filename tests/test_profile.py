"""Profiling one model on demand (`mpsd profile`, admin Profile) against the real daemon on the CPU.

Promises checked here:
- `mpsd profile MODEL --requests N --out FILE`, while a client keeps sending requests: every request is
  answered, the window ends after N requests, and FILE is a Chrome trace JSON holding the model's operators
  with their input shapes; the worker's private temporary files are gone afterwards;
- a request window counts every request of a batch, not executions;
- a second profile of the same worker while one runs is refused with RESOURCE_EXHAUSTED and says why;
- a token without the model-repository category is refused (PERMISSION_DENIED naming the category);
  without tokens, Profile follows auth.repository_changes_without_token (refused on a reachable address);
- a window out of bounds (too long, too many requests, none at all) is INVALID_ARGUMENT;
- a profiling worker may be silent for up to 120 s (exporting a long trace) until its ProfileDone;
- on MPS (a stand-in for torch.mps.profiler here, there is no Apple GPU), the worker calls start(mode,
  wait_until_completed) and stop() around the window and says how to record the signposts, with its pid;
  a GPU trace is captured with metal_capture and comes back zipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
import yaml

from mpsd.daemon.dataplane.channel import Channel
from mpsd.daemon.supervise.worker.liveness import Liveness
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.ipc import protocol as p
from mpsd.net.auth import AccessPolicy
from mpsd.proto import admin_pb2, admin_pb2_grpc
from mpsd.worker.profiling import Profiler
from tests import models
from tests.conftest import ROOT, RunningDaemon, serving, wait_for

ADMIN_TOKEN = "profile-admin-5e1d"
READER_TOKEN = "profile-reader-a0c2"
DIMS = 16


@dataclass
class Setup:
    daemon: RunningDaemon
    base: Path
    admin_token: Path
    reader_token: Path
    tmpdir: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("profile")
    repo = base / "repo"
    models.add_sub(repo, dims=DIMS)
    models.add_sub(repo, "other", dims=DIMS)
    # Batches form: requests wait up to 0.2 s for a batch of 4.
    batching = {"max_queue_delay_microseconds": 200_000, "preferred_batch_size": [4]}
    models.add_sub(repo, "batched", dims=DIMS, dynamic_batching=batching)
    admin, reader = base / "admin.token", base / "reader.token"
    admin.write_text(ADMIN_TOKEN)
    reader.write_text(READER_TOKEN)
    for f in (admin, reader):
        f.chmod(0o600)
    config = base / "mpsd.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "metrics_address": "",
                "auth": {
                    "tokens": [
                        {
                            "token_file": str(admin),
                            "categories": ["inference", "health", "model-repository", "logs-statistics"],
                        },
                        {"token_file": str(reader), "categories": ["inference", "health", "logs-statistics"]},
                    ],
                    "open_categories": ["health"],
                },
            }
        )
    )
    tmpdir = base / "worker-tmp"  # the workers' TMPDIR: where their private trace files would be left
    tmpdir.mkdir()
    with serving(repo, base / "daemon.log", config=config, env={"TMPDIR": str(tmpdir)}) as daemon:
        yield Setup(daemon, base, admin, reader, tmpdir)


def _stub(daemon: RunningDaemon) -> Any:
    return admin_pb2_grpc.MpsdAdminStub(grpc.insecure_channel(daemon.address))  # type: ignore[no-untyped-call]


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def _infer(client: grpcclient.InferenceServerClient, model: str = "add_sub") -> np.ndarray:
    a = np.arange(DIMS, dtype=np.float32)[None, :]
    inputs = [
        grpcclient.InferInput("INPUT0", [1, DIMS], "FP32"),
        grpcclient.InferInput("INPUT1", [1, DIMS], "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(a)
    result = client.infer(model, inputs, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    out = result.as_numpy("OUTPUT0")
    assert out is not None
    return out


def test_profile_command_returns_a_chrome_trace_of_live_requests(setup: Setup, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    command = [
        sys.executable,
        "-m",
        "mpsd",
        "profile",
        "add_sub",
        "--requests",
        "20",
        "--out",
        str(out),
        "--address",
        setup.daemon.address,
        "--token-file",
        str(setup.admin_token),
    ]
    cli = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    answered: list[np.ndarray] = []
    errors: list[BaseException] = []

    def send() -> None:  # live traffic until the command has its result
        client = grpcclient.InferenceServerClient(setup.daemon.address)
        try:
            while cli.poll() is None:
                answered.append(_infer(client))
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    sender = threading.Thread(target=send)
    sender.start()
    try:
        stdout, stderr = cli.communicate(timeout=120)
    finally:
        cli.kill()
        sender.join(60)
    assert cli.returncode == 0, stderr
    assert errors == []
    assert len(answered) >= 20
    expected = 2 * np.arange(DIMS, dtype=np.float32)[None, :]
    assert all(np.array_equal(a, expected) for a in answered)
    assert "window ended by requests: 20 requests" in stderr
    assert str(out) in stdout
    trace = json.loads(out.read_text())
    events = trace["traceEvents"]
    adds = [e for e in events if e.get("name") == "aten::add"]
    subs = [e for e in events if e.get("name") == "aten::sub"]
    assert adds and subs
    assert [[1, DIMS], [1, DIMS], []] in [e.get("args", {}).get("Input Dims") for e in adds]
    assert not [f for f in setup.tmpdir.iterdir() if f.name.startswith("mpsd-profile-")]


def test_a_request_window_counts_the_requests_of_each_batch(setup: Setup) -> None:
    call = _stub(setup.daemon).Profile(
        admin_pb2.ProfileRequest(model="batched", requests=8), metadata=_auth(ADMIN_TOKEN), timeout=120
    )
    events = iter(call)
    assert next(events).WhichOneof("event") == "started"
    done: list[Any] = []
    reader = threading.Thread(target=lambda: done.extend(e.done for e in events if e.HasField("done")))
    reader.start()

    def send() -> None:  # four clients at once: the batcher forms batches of up to 4
        client = grpcclient.InferenceServerClient(setup.daemon.address)
        try:
            while reader.is_alive():
                _infer(client, "batched")
        finally:
            client.close()

    senders = [threading.Thread(target=send) for _ in range(4)]
    for t in senders:
        t.start()
    reader.join(120)
    for t in senders:
        t.join(60)
    assert done and done[0].ended_by == "requests"
    assert done[0].requests >= 8 and done[0].executions < done[0].requests


def test_a_second_profile_of_the_same_worker_is_refused(setup: Setup) -> None:
    stub = _stub(setup.daemon)
    first = stub.Profile(
        admin_pb2.ProfileRequest(model="other", seconds=60), metadata=_auth(ADMIN_TOKEN), timeout=90
    )
    try:
        started = next(iter(first))
        assert started.WhichOneof("event") == "started"
        assert started.started.worker == "other/1#0" and started.started.kind == "torch"
        second = stub.Profile(
            admin_pb2.ProfileRequest(model="other", requests=5), metadata=_auth(ADMIN_TOKEN), timeout=30
        )
        with pytest.raises(grpc.RpcError) as refused:
            list(second)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already being profiled" in str(refused.value.details())
        # Serving goes on meanwhile.
        client = grpcclient.InferenceServerClient(setup.daemon.address)
        assert _infer(client, "other").shape == (1, DIMS)
        client.close()
    finally:
        first.cancel()

    # Cancelling ended the window: the worker takes a new profile.
    def profiled() -> bool:
        call = stub.Profile(
            admin_pb2.ProfileRequest(model="other", seconds=0.2), metadata=_auth(ADMIN_TOKEN), timeout=60
        )
        return [e.WhichOneof("event") for e in call][-1] == "done"

    wait_for(profiled, 60, "a new profile after the first was cancelled")


def test_a_token_without_the_model_repository_category_is_refused(setup: Setup) -> None:
    call = _stub(setup.daemon).Profile(
        admin_pb2.ProfileRequest(model="add_sub", requests=1), metadata=_auth(READER_TOKEN), timeout=30
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(call)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "'model-repository'" in str(refused.value.details())


def test_without_tokens_profile_follows_the_repository_changes_policy() -> None:
    profile = "/mpsd.v1.MpsdAdmin/Profile"
    reachable = AccessPolicy([], local_only=False, address="0.0.0.0:8001")
    refused = reachable.check(profile, None)
    assert refused is not None and refused.code.value == "PERMISSION_DENIED"
    assert "Profile is switched off" in refused.message
    assert AccessPolicy([], local_only=True).check(profile, None) is None
    assert AccessPolicy([], repository_changes="allow", local_only=False).check(profile, None) is None


@pytest.mark.parametrize(
    ("seconds", "requests", "says"),
    [
        (301.0, 0, "seconds must be between 0 and 300"),
        (0.0, 100_001, "requests must be at most"),
        (0.0, 0, "give the window"),
    ],
)
def test_a_window_out_of_bounds_is_refused(setup: Setup, seconds: float, requests: int, says: str) -> None:
    call = _stub(setup.daemon).Profile(
        admin_pb2.ProfileRequest(model="add_sub", seconds=seconds, requests=requests),
        metadata=_auth(ADMIN_TOKEN),
        timeout=30,
    )
    with pytest.raises(grpc.RpcError) as refused:
        list(call)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert says in str(refused.value.details())


class _Transport:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.sent.append(data)


def test_a_profiling_worker_may_be_silent_longer_until_its_profile_is_done() -> None:
    """Stopping torch.profiler and exporting a long window's trace hold the worker's interpreter (its
    heartbeat thread too) for seconds: from StartProfile to ProfileDone the watchdog allows 120 s."""

    async def scenario() -> None:
        spec = p.ModelSpec("m", 1, "torchscript", "/nowhere", 8, (), ())
        liveness = Liveness(WorkerLaunch(spec, 0, "KIND_CPU", None, {}), 10.0, lambda _: None)
        channel = Channel(spec, liveness, 0.0, lambda _: None)
        channel._transport = _Transport()  # type: ignore[assignment]
        assert liveness.too_silent(13.0)
        run = channel.start_profile(0, False)
        assert not liveness.too_silent(13.0) and liveness.too_silent(121.0)
        channel._on_message(p.ProfileDone(run.profile_id, 0, 0, 1.0, "stopped"))
        assert liveness.too_silent(13.0)

    asyncio.run(scenario())


# ---- MPS, with a stand-in for torch.mps.profiler ------------------------------------------------------


class StandInMpsProfiler:
    """Stands in for torch.mps.profiler (no Apple GPU here): records the calls the worker makes, and
    `metal_capture` writes a file where the real one writes its .gputrace bundle."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def start(self, mode: str = "interval", wait_until_completed: bool = False) -> None:
        self.calls.append(("start", {"mode": mode, "wait_until_completed": wait_until_completed}))

    def stop(self) -> None:
        self.calls.append(("stop", {}))

    def is_metal_capture_enabled(self) -> bool:
        return True

    def metal_capture(self, fname: str) -> Any:
        @contextlib.contextmanager
        def capture() -> Iterator[None]:
            self.calls.append(("capture", {"fname": fname}))
            os.makedirs(fname)
            Path(fname, "capture.bin").write_bytes(b"metal")
            yield
            self.calls.append(("capture_end", {}))

        return capture()


def test_on_mps_the_worker_emits_signposts_around_the_window_and_says_how_to_record_them() -> None:
    sent: list[object] = []
    api = StandInMpsProfiler()
    profiler = Profiler(torch.device("mps"), sent.append, mps_api=api)
    profiler.start(p.StartProfile(1, requests=2))
    assert sent == [p.ProfileStarted(1, "mps")]
    assert api.calls == [("start", {"mode": "interval", "wait_until_completed": False})]
    profiler.executed(1)
    assert api.calls[-1][0] == "start"
    profiler.executed(1)
    assert api.calls[-1] == ("stop", {})
    done = sent[-1]
    assert isinstance(done, p.ProfileDone) and done.requests == 2 and done.ended_by == "requests"
    notes = "\n".join(done.notes)
    assert f"--attach {os.getpid()}" in notes and "Instruments" in notes
    assert "full Xcode, not the Command Line Tools" in notes  # xctrace is not in the CLT

    sent.clear()
    api.calls.clear()
    profiler.start(p.StartProfile(2, mps_gpu_trace=True))
    assert [c[0] for c in api.calls] == ["start", "capture"]
    profiler.stop(2)
    assert [c[0] for c in api.calls] == ["start", "capture", "capture_end", "stop"]
    chunks = [m for m in sent if isinstance(m, p.ProfileChunk)]
    assert chunks and chunks[0].name == "model.gputrace.zip"
    archive = zipfile.ZipFile(io.BytesIO(b"".join(c.data for c in chunks)))
    assert archive.read("model.gputrace/capture.bin") == b"metal"
    assert not Path(api.calls[1][1]["fname"]).exists()  # the private copy is deleted


# ---- GPU -----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_profile_on_a_cuda_gpu_holds_its_kernels(tmp_path: Path) -> None:
    models.add_sub(tmp_path / "repo", dims=DIMS, instance_group=[{"kind": "KIND_GPU"}])
    with serving(tmp_path / "repo", tmp_path / "daemon.log") as daemon:
        stub = _stub(daemon)
        call = stub.Profile(admin_pb2.ProfileRequest(model="add_sub", requests=10), timeout=120)
        client = grpcclient.InferenceServerClient(daemon.address)
        chunks: list[bytes] = []
        done: list[Any] = []

        def read() -> None:
            for event in call:
                if event.WhichOneof("event") == "data":
                    chunks.append(event.data.data)
                elif event.WhichOneof("event") == "done":
                    done.append(event.done)

        reader = threading.Thread(target=read)
        reader.start()
        try:
            while reader.is_alive():
                _infer(client)
        finally:
            reader.join(120)
            client.close()
        assert done and done[0].ended_by == "requests"
        events = json.loads(b"".join(chunks))["traceEvents"]
        assert any(e.get("cat") == "kernel" for e in events)
        assert any(e.get("name") == "aten::add" for e in events)
