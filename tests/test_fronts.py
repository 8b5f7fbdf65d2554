"""Front processes (`front_processes: N`): gRPC spread over processes sharing the port, one daemon behind.

Checked against real daemons with two fronts, real workers and the stock tritonclient:

- every kind of RPC works through a front: ModelInfer on the fast path, the others (unary, server
  streaming, bidirectional) relayed to the daemon, with the same answers and the same error statuses;
- connections are spread over the fronts (the kernel's SO_REUSEPORT balancing), counted in the metrics;
- deadlines reach the daemon, tokens and TLS are enforced at the front, system shared memory works;
- a killed front is restarted, a killed daemon takes its fronts with it, SIGTERM drains through them;
- settings the address cannot serve (a Unix socket, port 0) are configuration errors; a port in use fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import psutil
import pytest
import tritonclient.grpc as grpcclient
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from mpsd.config.daemon_config import DaemonConfig
from mpsd.daemon.supervise.fronts.pool import is_front_command
from mpsd.proto import admin_pb2, admin_pb2_grpc
from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port, own_segments, pending_requests, serving, wait_for
from tests.os_skips import shared_port_fronts

# Every test here runs fronts that share the daemon's port (some read /proc too): Linux's. The parts of
# fronts that run on every platform are tested in test_front_policy.py.
pytestmark = shared_port_fronts()

FRONTS = 2
BIG_DIMS = 300_000  # 1.2 MB per tensor: requests and replies of 2.4 MB, larger than the link's socket buffer
WIDE_DIMS = 40_000  # 160 KB per row: above the size the worker reads in place (marshal.IN_PLACE_BYTES)
SLOW = """
time.sleep(float(inputs['x'][0]))
return {'y': inputs['x'] * 2}
"""


def front_pids(daemon: RunningDaemon) -> list[int]:
    try:
        children = psutil.Process(daemon.pid).children()
    except psutil.NoSuchProcess:
        return []
    return [p.pid for p in children if is_front_command(p.cmdline())]


def scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        match = re.match(r"^(mpsd_front_\w+(?:\{[^}]*\})?) (\S+)$", line)
        if match:
            values[match.group(1)] = float(match.group(2))
    return values


def add_sub_inputs(a: np.ndarray, b: np.ndarray) -> list[grpcclient.InferInput]:
    inputs = []
    for name, value in (("INPUT0", a), ("INPUT1", b)):
        inp = grpcclient.InferInput(name, list(value.shape), "FP32")
        inp.set_data_from_numpy(value)
        inputs.append(inp)
    return inputs


def slow_input(seconds: float) -> list[grpcclient.InferInput]:
    inp = grpcclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.array([seconds], np.float32))
    return [inp]


def status_of(call: object) -> tuple[str, str]:
    with pytest.raises(InferenceServerException) as info:
        call()  # type: ignore[operator]
    return str(info.value.status()), str(info.value.message())


class Setup:
    def __init__(self, daemon: RunningDaemon, metrics_port: int, repo: Path) -> None:
        self.daemon = daemon
        self.metrics_port = metrics_port
        self.repo = repo


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    base = tmp_path_factory.mktemp("fronts")
    repo = base / "repo"
    models.add_sub(repo)
    models.add_sub(repo, "add_sub_big", dims=BIG_DIMS, max_batch_size=0)
    # Batches of large rows: both inputs of every request in a front's arena, where the worker reads them.
    models.add_sub(
        repo,
        "add_sub_wide",
        dims=WIDE_DIMS,
        max_batch_size=4,
        dynamic_batching={"max_queue_delay_microseconds": 200_000, "preferred_batch_size": [4]},
    )
    models.python_model(repo, "slow", SLOW)
    models.python_model(repo, "doubled", "return {'y': torch.cat([inputs['x'], inputs['x']])}")
    models.python_model(
        repo,
        "countdown",
        "for k in range(int(inputs['x'].numel())):\n    time.sleep(0.2)\n    yield {'y': inputs['x'][k:]}",
        config={
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "model_transaction_policy": {"decoupled": True},
        },
    )
    metrics_port = free_port()
    args = ["--front-processes", str(FRONTS), "--metrics-address", f"127.0.0.1:{metrics_port}"]
    with serving(repo, base / "daemon.log", extra_args=args) as daemon:
        yield Setup(daemon, metrics_port, repo)


def test_the_fronts_listen_and_the_daemon_does_not_hold_the_port_alone(setup: Setup) -> None:
    fronts = front_pids(setup.daemon)
    assert len(fronts) == FRONTS
    listening = {
        c.pid
        for c in psutil.net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == setup.daemon.port
    }
    assert set(fronts) <= listening, "every front listens on the shared port"
    assert setup.daemon.pid not in listening, "the daemon serves its fronts on a private socket"
    assert scrape(setup.metrics_port)["mpsd_front_processes"] == FRONTS


def test_every_process_is_named_by_its_role_in_ps(setup: Setup) -> None:
    """`ps` and Activity Monitor show what each process is: the daemon with its address, each front with
    its index, each worker with its model, version, instance and device."""

    def title(pid: int) -> str:
        return " ".join(psutil.Process(pid).cmdline()).strip()

    assert title(setup.daemon.pid) == f"mpsd: daemon {setup.daemon.address}"
    fronts = sorted(title(pid) for pid in front_pids(setup.daemon))
    assert fronts == [f"mpsd: front {i}" for i in range(FRONTS)]
    (worker,) = setup.daemon.started_workers("add_sub")
    events = [json.loads(line) for line in setup.daemon.log().splitlines() if line.startswith("{")]
    (ready,) = [e for e in events if e["event"] == "worker ready" and e["pid"] == worker]
    assert title(worker) == f"mpsd: worker add_sub/1#0 ({ready['device']})"  # cpu here, cuda on a GPU


def test_every_process_settles_its_collector_once_started(setup: Setup) -> None:
    """The daemon once its models are loaded, each front once it listens and each worker once its model is
    warm freeze what start-up made out of the collector's scans (`mpsd.ipc.heap.settle_collector`), and
    say how much in the event that says they are ready."""
    events = [json.loads(line) for line in setup.daemon.log().splitlines() if line.startswith("{")]
    frozen = {
        role: [e.get("frozen_objects", 0) for e in events if e["event"] == event]
        for role, event in (("daemon", "ready"), ("front", "front listening"), ("worker", "worker ready"))
    }
    assert len(frozen["daemon"]) == 1 and len(frozen["front"]) >= FRONTS and frozen["worker"], frozen
    assert all(n > 10_000 for counts in frozen.values() for n in counts), frozen


def fixed_mappings(pid: int) -> set[str]:
    """Where the kernel put a process's stack and vDSO: chosen at random at each exec (ASLR), and kept by
    fork, so a child that shares them with its parent is a fork that never exec'd."""
    with open(f"/proc/{pid}/maps") as maps:
        return {line.split()[0] for line in maps if line.rstrip().endswith(("[stack]", "[vdso]"))}


def test_every_child_process_is_started_by_exec_never_forked(setup: Setup) -> None:
    """docs/architecture.md and docs/devices.md: workers and fronts are exec'd, never forked (a forked
    process hangs or crashes on its first Metal call)."""
    if Path("/proc/sys/kernel/randomize_va_space").read_text().strip() == "0":
        pytest.skip("address space randomisation is off: an exec'd process has its parent's layout too")
    daemon = setup.daemon
    parent = fixed_mappings(daemon.pid)
    assert parent, "the daemon's stack and vDSO are in its maps"
    children = psutil.Process(daemon.pid).children(recursive=True)
    fronts = [p.pid for p in children if is_front_command(p.cmdline())]
    assert len(fronts) == FRONTS and len(children) > FRONTS, [p.cmdline() for p in children]
    forked = [" ".join(p.cmdline()) for p in children if fixed_mappings(p.pid) & parent]
    assert not forked, f"forked from the daemon without exec: {forked}"


def test_fronts_are_listed_with_the_workers_and_in_mpsd_status(setup: Setup) -> None:
    with grpc.insecure_channel(setup.daemon.address) as channel:
        admin = admin_pb2_grpc.MpsdAdminStub(channel)
        listed = admin.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
        filtered = admin.ListWorkers(admin_pb2.ListWorkersRequest(model="add_sub"), timeout=10)
    assert sorted(f.index for f in listed.fronts) == list(range(FRONTS))
    assert sorted(f.pid for f in listed.fronts) == sorted(front_pids(setup.daemon))
    assert {f.state for f in listed.fronts} == {"listening"}
    assert not filtered.fronts, "a model filter lists that model's workers only"
    run = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--json", "--address", setup.daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    fronts = json.loads(run.stdout)["fronts"]
    assert sorted(f["pid"] for f in fronts) == sorted(front_pids(setup.daemon))
    text = subprocess.run(
        [sys.executable, "-m", "mpsd", "status", "--address", setup.daemon.address],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert "FRONT" in text and all(str(pid) in text for pid in front_pids(setup.daemon))


def test_every_rpc_shape_through_a_front(setup: Setup) -> None:
    client = setup.daemon.client
    assert client.is_server_live() and client.is_server_ready()
    assert client.get_server_metadata().name == "mpsd"
    assert client.is_model_ready("add_sub")
    assert [i.name for i in client.get_model_metadata("add_sub").inputs] == ["INPUT0", "INPUT1"]
    assert client.get_model_config("add_sub").config.max_batch_size == 8
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    b = np.ones((1, 16), np.float32)
    result = client.infer("add_sub", add_sub_inputs(a, b), request_id="r1")
    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
    np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert result.get_response().id == "r1"
    stats = client.get_inference_statistics("add_sub").model_stats[0]
    assert stats.inference_stats.success.count >= 1
    names = {m.name for m in client.get_model_repository_index().models}
    assert {"add_sub", "slow"} <= names

    # bidirectional streaming, relayed: responses in order
    answers: list[object] = []
    done = threading.Event()

    def on_response(result: object, error: object) -> None:
        answers.append(error or result)
        if len(answers) == 3:
            done.set()

    client.start_stream(callback=on_response)
    try:
        for k in range(3):
            client.async_stream_infer("add_sub", add_sub_inputs(a * k, b), request_id=str(k))
        assert done.wait(30)
    finally:
        client.stop_stream()
    assert [r.get_response().id for r in answers] == ["0", "1", "2"]  # type: ignore[attr-defined]

    # the gRPC health service (unary Check through the relay)
    with grpc.insecure_channel(setup.daemon.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_decoupled_model_streams_through_a_front(setup: Setup) -> None:
    """A front relays ModelStreamInfer as it is: each of a decoupled model's responses reaches the client,
    in order, then the empty final response."""
    client = grpcclient.InferenceServerClient(setup.daemon.address)
    got: list[tuple[float, object]] = []
    finished = threading.Event()

    def on_response(result: object, error: object) -> None:
        got.append((time.monotonic(), error or result))
        if error is not None or result.get_response().parameters["triton_final_response"].bool_param:  # type: ignore[attr-defined]
            finished.set()

    x = grpcclient.InferInput("x", [3], "FP32")
    x.set_data_from_numpy(np.array([1, 2, 3], np.float32))
    client.start_stream(callback=on_response)
    try:
        client.async_stream_infer("countdown", [x], enable_empty_final_response=True)
        assert finished.wait(30)
    finally:
        client.stop_stream()
        client.close()
    sizes = [len(r.as_numpy("y")) if r.as_numpy("y") is not None else 0 for _, r in got]  # type: ignore[attr-defined]
    assert sizes == [3, 2, 1, 0], got


def arena_transfers(setup: Setup) -> tuple[float, float]:
    """(requests, replies) that went through the fronts' arenas so far."""
    values = scrape(setup.metrics_port)
    total = {"request": 0.0, "reply": 0.0}
    for key, value in values.items():
        if key.startswith("mpsd_front_arena_transfers_total{"):
            total["request" if 'direction="request"' in key else "reply"] += value
    return total["request"], total["reply"]


def split_requests(setup: Setup) -> float:
    """Calls the fronts cut apart themselves so far (the daemon took their spans, not their bytes)."""
    values = scrape(setup.metrics_port)
    return sum(v for k, v in values.items() if k.startswith("mpsd_front_split_requests_total{"))


def test_large_requests_and_replies_through_a_front(setup: Setup) -> None:
    """Large requests and replies go through the front's shared-memory arena, and arrive whole; the front
    cut each request apart itself, and the daemon answered from where it said the tensor bytes were."""
    rng = np.random.default_rng(7)
    requests, replies = arena_transfers(setup)
    split = split_requests(setup)
    for _ in range(3):
        a = rng.standard_normal((BIG_DIMS,), dtype=np.float32)
        b = rng.standard_normal((BIG_DIMS,), dtype=np.float32)
        result = setup.daemon.client.infer("add_sub_big", add_sub_inputs(a, b))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + b)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), a - b)
    assert arena_transfers(setup) == (requests + 3, replies + 3)
    assert split_requests(setup) == split + 3


def bytes_in_place(port: int, model: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    pattern = rf'^mpsd_worker_input_bytes_in_place_total\{{[^}}]*model="{model}"[^}}]*\}} (\S+)$'
    return sum(float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE))


def test_the_worker_reads_batched_rows_from_the_fronts_arenas_itself(setup: Setup) -> None:
    """Requests that came through a front lie in its arena: the worker, which inherited the arena, takes
    their rows from there (the daemon copies none), and every request gets its own rows back."""
    rng = np.random.default_rng(11)
    before = bytes_in_place(setup.metrics_port, "add_sub_wide")
    rows = [rng.standard_normal((1, WIDE_DIMS), dtype=np.float32) for _ in range(8)]
    done: list[tuple[int, object]] = []
    finished = threading.Event()

    def callback(k: int) -> object:
        def record(result: object, error: object) -> None:
            done.append((k, error if error is not None else result))
            if len(done) == len(rows):
                finished.set()

        return record

    client = grpcclient.InferenceServerClient(setup.daemon.address)
    try:
        for k, a in enumerate(rows):
            client.async_infer("add_sub_wide", add_sub_inputs(a, 2 * a), callback(k))
        assert finished.wait(60)
    finally:
        client.close()
    for k, result in done:
        assert isinstance(result, grpcclient.InferResult), result
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 3 * rows[k])
        np.testing.assert_array_equal(result.as_numpy("OUTPUT1"), -rows[k])
    stats = setup.daemon.client.get_inference_statistics("add_sub_wide").model_stats[0]
    assert any(b.batch_size > 1 for b in stats.batch_stats), "the requests were batched"
    assert bytes_in_place(setup.metrics_port, "add_sub_wide") - before == 8 * 2 * WIDE_DIMS * 4


def test_workers_can_be_kept_out_of_the_arenas(tmp_path: Path) -> None:
    """`arenas_to_workers: false`: the arenas hold every model's calls, so where models must not see each
    other's data the workers map none, and the daemon copies their inputs."""
    repo = tmp_path / "repo"
    models.add_sub(repo, "wide", dims=WIDE_DIMS, max_batch_size=4)
    port = free_port()
    config = tmp_path / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"arenas_to_workers": False, "metrics_address": f"127.0.0.1:{port}"}))
    with serving(
        repo, tmp_path / "daemon.log", config=config, extra_args=["--front-processes", "1"]
    ) as daemon:
        a = np.random.default_rng(13).standard_normal((1, WIDE_DIMS), dtype=np.float32)
        result = daemon.client.infer("wide", add_sub_inputs(a, a))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * a)
        assert bytes_in_place(port, "wide") == 0
        (worker,) = daemon.started_workers("wide")
        if Path("/proc").is_dir():
            assert arena_mappings(worker) == 0


def test_a_reply_larger_than_its_request_comes_back_through_the_socket(setup: Setup) -> None:
    """The reply does not fit the request's chunk: it leaves the daemon as pieces (header, then each
    output behind its tag), which must arrive as the one message they make up, for tensors larger than the
    link's socket buffer too."""
    x = np.random.default_rng(8).standard_normal((BIG_DIMS,), dtype=np.float32)
    requests, replies = arena_transfers(setup)
    for _ in range(2):
        inp = grpcclient.InferInput("x", [BIG_DIMS], "FP32")
        inp.set_data_from_numpy(x)
        result = setup.daemon.client.infer("doubled", [inp])
        np.testing.assert_array_equal(result.as_numpy("y"), np.concatenate([x, x]))
    assert arena_transfers(setup) == (requests + 2, replies)


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_the_daemon_and_its_fronts_serve_on_either_event_loop(tmp_path: Path, event_loop: str) -> None:
    """The suite runs on the default (asyncio's loop); this runs a daemon and a front on each, the daemon's
    loop gathering under load (`gather_us`)."""
    if event_loop == "uvloop":
        pytest.importorskip("uvloop")
    repo = tmp_path / "repo"
    models.add_sub(repo)
    config = tmp_path / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"event_loop": event_loop, "metrics_address": "", "gather_us": 300}))
    args = ["--front-processes", "1"]
    with serving(repo, tmp_path / "daemon.log", config=config, extra_args=args) as daemon:
        a = np.arange(16, dtype=np.float32).reshape(1, 16)
        result = daemon.client.infer("add_sub", add_sub_inputs(a, a))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a + a)
        events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    starts = ("listening", "front listening")
    loops = {e["event"]: (e.get("event_loop"), e.get("busy_poll_us")) for e in events if e["event"] in starts}
    # By default neither loop polls where fronts run (`policy.busy_poll_us`); uvloop's loop never does.
    polls = 0
    assert loops == {"listening": (event_loop, polls), "front listening": (event_loop, polls)}
    # The daemon's loop gathers as configured, and served meanwhile; uvloop's cannot.
    gathers = [e.get("gather_us") for e in events if e["event"] == "listening"]
    assert gathers == [300 if event_loop == "asyncio" else 0]


def test_errors_keep_their_status_through_a_front(setup: Setup) -> None:
    client = setup.daemon.client
    code, message = status_of(
        lambda: client.infer(
            "nope", add_sub_inputs(np.ones((1, 16), np.float32), np.ones((1, 16), np.float32))
        )
    )
    assert code == "StatusCode.NOT_FOUND" and "nope" in message
    bad = np.ones((1, 15), np.float32)
    code, message = status_of(lambda: client.infer("add_sub", add_sub_inputs(bad, bad)))
    assert code == "StatusCode.INVALID_ARGUMENT" and "INPUT0" in message
    code, _ = status_of(lambda: client.get_model_metadata("nope"))
    assert code == "StatusCode.NOT_FOUND"
    with grpc.insecure_channel(setup.daemon.address) as channel:
        for method in ("ModelInfer", "ModelMetadata"):  # fast path and relay: undecodable bytes
            call = channel.unary_unary(f"/inference.GRPCInferenceService/{method}")
            with pytest.raises(grpc.RpcError) as info:
                call(b"\xff\xff\xff", timeout=10)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid protobuf message" in (info.value.details() or "")
        unknown = channel.unary_unary("/inference.GRPCInferenceService/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as info:
            unknown(b"", timeout=10)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert client.is_server_ready(), "the daemon is unharmed"


def test_connections_are_spread_over_the_fronts(setup: Setup) -> None:
    before = scrape(setup.metrics_port)
    a = np.ones((1, 16), np.float32)
    # Channels to one target share one connection unless each has its own subchannel pool.
    own_connection = [("grpc.use_local_subchannel_pool", 1)]
    clients = [
        grpcclient.InferenceServerClient(setup.daemon.address, channel_args=own_connection) for _ in range(16)
    ]
    try:
        for _ in range(3):
            for c in clients:
                c.infer("add_sub", add_sub_inputs(a, a))
    finally:
        for c in clients:
            c.close()
    after = scrape(setup.metrics_port)
    handed = {k: after[k] - before.get(k, 0.0) for k in after if k.startswith("mpsd_front_requests_total")}
    assert sum(handed.values()) == 48, handed
    assert sum(v > 0 for v in handed.values()) >= 2, f"16 connections all went to one front: {handed}"


def test_deadline_reaches_the_daemon_and_cancelled_calls_end(setup: Setup) -> None:
    client = setup.daemon.client
    code, _ = status_of(lambda: client.infer("slow", slow_input(1.0), client_timeout=0.3))
    assert code == "StatusCode.DEADLINE_EXCEEDED"
    # queued behind the one still sleeping, this call's deadline passes in the daemon's queue
    code, _ = status_of(lambda: client.infer("slow", slow_input(0.0), client_timeout=0.3))
    assert code == "StatusCode.DEADLINE_EXCEEDED"
    # The calls ended (no deadline here): the next is answered once the sleeping one is done.
    assert client.infer("slow", slow_input(0.0)).as_numpy("y").tolist() == [0.0]


def test_system_shared_memory_through_a_front(setup: Setup) -> None:
    from tests.triton_shm import shm

    client = setup.daemon.client
    a = np.arange(16, dtype=np.float32).reshape(1, 16)
    handle = shm.create_shared_memory_region("fronts_in", f"/fronts_in_{os.getpid()}", a.nbytes * 2)
    try:
        shm.set_shared_memory_region(handle, [a, a])
        client.register_system_shared_memory("fronts_in", f"/fronts_in_{os.getpid()}", a.nbytes * 2)
        inputs = add_sub_inputs(a, a)
        inputs[0].set_shared_memory("fronts_in", a.nbytes)
        inputs[1].set_shared_memory("fronts_in", a.nbytes, offset=a.nbytes)
        result = client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
        # Outputs into shared memory: a reply whose last (or only) output has no bytes in the message. Every
        # output there leaves the front nothing but the message's metadata to send on.
        b = np.full((1, 16), 5.0, dtype=np.float32)
        out_handle = shm.create_shared_memory_region("fronts_out", f"/fronts_out_{os.getpid()}", a.nbytes * 2)
        try:
            client.register_system_shared_memory("fronts_out", f"/fronts_out_{os.getpid()}", a.nbytes * 2)
            for in_shm in ("OUTPUT1", "OUTPUT0"):
                shm.set_shared_memory_region(out_handle, [np.zeros((2, 16), np.float32)])
                out0 = grpcclient.InferRequestedOutput("OUTPUT0")
                out1 = grpcclient.InferRequestedOutput("OUTPUT1")
                out1.set_shared_memory("fronts_out", a.nbytes, offset=a.nbytes)
                if in_shm == "OUTPUT0":
                    out0.set_shared_memory("fronts_out", a.nbytes)
                result = client.infer("add_sub", add_sub_inputs(b, a), outputs=[out0, out1])
                got = shm.get_contents_as_numpy(out_handle, np.float32, [2, 16])
                np.testing.assert_array_equal(got[1:], b - a)
                if in_shm == "OUTPUT0":
                    np.testing.assert_array_equal(got[:1], b + a)
                    assert list(result.get_output("OUTPUT0").shape) == [1, 16]
                    assert [len(r) for r in result.get_response().raw_output_contents] == [0, 0]
                else:
                    np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), b + a)
            client.unregister_system_shared_memory("fronts_out")
        finally:
            shm.destroy_shared_memory_region(out_handle)
        status = client.get_system_shared_memory_status()
        assert "fronts_in" in {r.name for r in status.regions.values()}
        client.unregister_system_shared_memory("fronts_in")
    finally:
        shm.destroy_shared_memory_region(handle)


def arena_mappings(pid: int) -> int:
    """The fronts' arenas a process has mapped (Linux: named in /proc/PID/maps, their size the default)."""
    count = 0
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split()
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if len(fields) > 5 and "/mpsd-" in fields[5] and end - start == DaemonConfig().front_arena_bytes:
            count += 1
    return count


def test_a_killed_front_is_restarted(setup: Setup) -> None:
    """Its arena is gone from the workers that had mapped it; its successor's is not theirs (they were
    started before it), so their requests through it are copied by the daemon, whole as ever."""
    (worker,) = setup.daemon.started_workers("add_sub_wide")
    if Path("/proc").is_dir():
        assert arena_mappings(worker) == FRONTS
    victim = front_pids(setup.daemon)[0]
    psutil.Process(victim).kill()
    wait_for(
        lambda: len(front_pids(setup.daemon)) == FRONTS and victim not in front_pids(setup.daemon),
        30,
        "the front restarted",
    )
    wait_for(lambda: scrape(setup.metrics_port)["mpsd_front_processes"] == FRONTS, 30, "front listening")

    def restarts() -> dict[str, float]:
        return {k: v for k, v in scrape(setup.metrics_port).items() if k.startswith("mpsd_front_restarts")}

    wait_for(lambda: sum(restarts().values()) == 1, 30, "the restart counted")
    assert sum(restarts().values()) == 1, restarts()
    a = np.ones((1, 16), np.float32)
    for _ in range(8):  # new connections, wherever the kernel sends them
        fresh = grpcclient.InferenceServerClient(
            setup.daemon.address, channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            np.testing.assert_array_equal(
                fresh.infer("add_sub", add_sub_inputs(a, a)).as_numpy("OUTPUT0"), a * 2
            )
        finally:
            fresh.close()
    if Path("/proc").is_dir():
        wait_for(
            lambda: arena_mappings(worker) == FRONTS - 1, 30, "the worker unmapped the dead front's arena"
        )
    wide = np.random.default_rng(12).standard_normal((1, WIDE_DIMS), dtype=np.float32)
    for _ in range(4):
        fresh = grpcclient.InferenceServerClient(
            setup.daemon.address, channel_args=[("grpc.use_local_subchannel_pool", 1)]
        )
        try:
            result = fresh.infer("add_sub_wide", add_sub_inputs(wide, wide))
            np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), 2 * wide)
        finally:
            fresh.close()


def write_config(path: Path, **settings: object) -> Path:
    path.write_text(yaml.safe_dump({"metrics_address": "", **settings}))
    return path


def serve_once(repo: Path, config: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mpsd",
            "serve",
            "--model-repository",
            str(repo),
            "--config",
            str(config),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def test_settings_the_address_cannot_serve_are_configuration_errors(tmp_path: Path, sock_dir: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    unix = write_config(tmp_path / "unix.yaml", grpc_address=f"unix://{sock_dir}/m.sock", front_processes=2)
    done = serve_once(repo, unix)
    assert done.returncode == 78, done.stderr
    assert "front_processes: 2" in done.stderr and "Unix socket" in done.stderr
    zero = write_config(tmp_path / "zero.yaml", grpc_address="127.0.0.1:0", front_processes=2)
    done = serve_once(repo, zero)
    assert done.returncode == 78 and "fixed port" in done.stderr, done.stderr
    # docs/security.md: the daemon refuses a port anything already listens on. The holder shares the port
    # (SO_REUSEPORT, of this user): the kernel would let the fronts join it, so only the daemon's own check
    # keeps another process from taking a share of the connections.
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        busy = write_config(tmp_path / "busy.yaml", grpc_address=f"127.0.0.1:{port}", front_processes=2)
        done = serve_once(repo, busy)
    assert done.returncode == 78 and "the port is in use" in done.stderr, done.stderr


CATEGORIES = ["inference", "health", "logs-statistics"]


def test_fronts_follow_the_daemons_log_level(tmp_path: Path) -> None:
    """A front filters its own events before the daemon sees them, so a level changed at runtime
    (LogSettings here; SIGHUP takes the same path) must reach it, and a front started later too."""
    from tests.test_security import bearer

    repo = tmp_path / "repo"
    models.add_sub(repo)
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "token").chmod(0o600)
    config = write_config(
        tmp_path / "mpsd.yaml",
        front_processes=1,
        log_level="warning",
        auth={"tokens": [{"token_file": str(tmp_path / "token"), "categories": CATEGORIES}]},
    )
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", config=config)
    client = daemon.client
    token = bearer("s3cret-token")

    def refusals() -> int:
        return sum('"call refused"' in line for line in daemon.log().splitlines())

    try:
        wait_for(lambda: client.is_server_ready(headers=token), 120, f"ready\n{daemon.log()}")
        assert status_of(lambda: client.get_model_metadata("add_sub"))[0] == "StatusCode.UNAUTHENTICATED"
        client.update_log_settings({"log_info": True}, headers=token)  # warning -> info

        def refused_and_logged() -> bool:
            """The new level reaches the front after the call that set it returns: refused calls go on
            until one is logged."""
            assert status_of(lambda: client.get_model_metadata("add_sub"))[0] == "StatusCode.UNAUTHENTICATED"
            return refusals() >= 1

        wait_for(refused_and_logged, 30, f"refusal logged\n{daemon.log()}")
        before_change = daemon.log().split('"log settings changed"')[0]
        assert '"call refused"' not in before_change, "the refusal at level warning was logged"

        (old,) = front_pids(daemon)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: len(front_pids(daemon)) == 1 and front_pids(daemon) != [old], 60, "front restarted")
        wait_for(lambda: client.is_server_ready(headers=token), 60, f"ready again\n{daemon.log()}")
        logged = refusals()
        assert status_of(lambda: client.get_model_metadata("add_sub"))[0] == "StatusCode.UNAUTHENTICATED"
        wait_for(lambda: refusals() == logged + 1, 30, f"the restarted front logs at info\n{daemon.log()}")
    finally:
        client.close()
        daemon.stop()
        daemon.kill_group()


def test_tokens_and_tls_are_enforced_at_the_front(tmp_path: Path) -> None:
    from tests.test_security import bearer, make_pki

    repo = tmp_path / "repo"
    models.add_sub(repo)
    (tmp_path / "pki").mkdir()
    pki = make_pki(tmp_path / "pki")
    (tmp_path / "token").write_text("s3cret-token\n")
    (tmp_path / "token").chmod(0o600)
    config = write_config(
        tmp_path / "mpsd.yaml",
        front_processes=2,
        tls={"cert_file": str(pki.server_cert), "key_file": str(pki.server_key)},
        auth={"tokens": [{"token_file": str(tmp_path / "token"), "categories": CATEGORIES}]},
    )
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", config=config)
    client = grpcclient.InferenceServerClient(daemon.address, ssl=True, root_certificates=str(pki.ca))
    try:
        wait_for(
            lambda: client.is_server_ready(headers=bearer("s3cret-token")), 120, f"ready\n{daemon.log()}"
        )
        assert len(front_pids(daemon)) == 2
        a = np.ones((1, 16), np.float32)
        code, _ = status_of(lambda: client.infer("add_sub", add_sub_inputs(a, a)))
        assert code == "StatusCode.UNAUTHENTICATED"
        code, _ = status_of(lambda: client.get_model_metadata("add_sub"))
        assert code == "StatusCode.UNAUTHENTICATED"
        code, message = status_of(lambda: client.get_model_repository_index(headers=bearer("s3cret-token")))
        assert code == "StatusCode.PERMISSION_DENIED" and "model-repository" in message
        # The fronts' refusals are the daemon's log events too: in the stream `mpsd logs` reads.
        with grpc.secure_channel(
            daemon.address, grpc.ssl_channel_credentials(pki.ca.read_bytes())
        ) as channel:
            stream = admin_pb2_grpc.MpsdAdminStub(channel).StreamLogs(
                admin_pb2.StreamLogsRequest(replay=2000), metadata=bearer("s3cret-token").items(), timeout=30
            )
            refused = [e for e in stream if e.message == "call refused"]
        assert len(refused) == 3, refused
        assert {e.fields["front"] for e in refused} <= {"0", "1"}
        assert any("RepositoryIndex" in e.fields["method"] for e in refused)
        result = client.infer("add_sub", add_sub_inputs(a, a), headers=bearer("s3cret-token"))
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), a * 2)
        plain = grpcclient.InferenceServerClient(daemon.address)
        with pytest.raises(InferenceServerException):
            plain.is_server_live(headers=bearer("s3cret-token"), client_timeout=3)
        plain.close()
    finally:
        client.close()
        daemon.stop()
        daemon.kill_group()


def test_sigterm_drains_through_the_fronts_and_kill_9_of_the_daemon_takes_them_along(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.python_model(repo, "slow", SLOW)
    metrics = f"127.0.0.1:{free_port()}"
    args = ["--front-processes", "2", "--metrics-address", metrics]
    daemon = RunningDaemon(repo, tmp_path / "daemon.log", extra_args=args)
    try:
        daemon.wait_ready()
        fronts = front_pids(daemon)
        results: list[object] = []

        def call() -> None:
            c = grpcclient.InferenceServerClient(daemon.address)
            try:
                results.append(c.infer("slow", slow_input(1.5)).as_numpy("y").tolist())
            except InferenceServerException as exc:
                results.append(exc)
            finally:
                c.close()

        caller = threading.Thread(target=call)
        caller.start()
        # SIGTERM once the call is in the daemon (through a front), not after a guessed delay.
        wait_for(lambda: pending_requests(metrics) == 1, 30, "the call in the daemon")
        daemon.proc.send_signal(signal.SIGTERM)
        caller.join(30)
        assert results == [[3.0]], results
        assert daemon.proc.wait(60) == 0
        wait_for(lambda: not any(psutil.pid_exists(p) for p in fronts), 10, "fronts gone")
        assert own_segments(daemon) == set()
    finally:
        daemon.stop()
        daemon.kill_group()

    second = RunningDaemon(repo, tmp_path / "second.log", extra_args=["--front-processes", "2"])
    try:
        second.wait_ready()
        fronts = front_pids(second)
        assert len(fronts) == 2
        second.proc.send_signal(signal.SIGKILL)
        second.proc.wait(10)
        wait_for(
            lambda: (
                not any(
                    psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                    for p in fronts
                )
            ),
            15,
            "fronts exit after the daemon died",
        )
    finally:
        second.stop()
        second.kill_group()
