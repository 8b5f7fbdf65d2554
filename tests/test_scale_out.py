"""Three real daemons on loopback serving one repository, balanced two ways under steady load: by the stock
tritonclient with gRPC's client-side round_robin, health checking and retries (`mpsd.client`), and by a
real HAProxy with deploy/haproxy/mpsd.cfg (gRPC over HTTP/2 end to end, HTTP routed per model). A daemon
stopped with SIGTERM fails no request either way; one killed with SIGKILL fails none for the client with
retries, and through HAProxy at most the calls that were in flight."""

from __future__ import annotations

import shutil
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import grpc
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.haproxy import HAProxy
from mpsd.client import balanced_channel_args, balanced_target
from tests import models
from tests.conftest import RunningDaemon, free_port, http_request, wait_for
from tests.os_skips import not_installed

GRACE_S = 3.0  # longer than HAProxy's check interval times its fall count (deploy/haproxy/mpsd.cfg)
CALLERS = 4
HAPROXY = shutil.which("haproxy")
BODY = (
    b'{"inputs": [{"name": "INPUT0", "shape": [1, 4], "datatype": "FP32", "data": [1, 2, 3, 4]},'
    b' {"name": "INPUT1", "shape": [1, 4], "datatype": "FP32", "data": [1, 1, 1, 1]}]}'
)


class Fleet:
    """Three daemons on one repository; one that a test stopped is started again on its ports."""

    def __init__(self, repo: Path, logs: Path) -> None:
        self.repo, self.logs, self.starts = repo, logs, 0
        self.daemons = [self._start() for _ in range(3)]
        for daemon in self.daemons:
            daemon.wait_ready()

    def _start(self, port: int | None = None, http: str | None = None) -> RunningDaemon:
        self.starts += 1
        http = http or f"127.0.0.1:{free_port()}"
        args = ["--http-address", http, "--metrics-address", "off", "--front-processes", "0"]
        log = self.logs / f"daemon{self.starts}.log"
        return RunningDaemon(self.repo, log, extra_args=args, shutdown_grace=GRACE_S, port=port)

    def restart(self, index: int) -> None:
        old = self.daemons[index]
        old.stop()
        old.kill_group()
        self.daemons[index] = self._start(old.port, old.http_address)
        self.daemons[index].wait_ready()

    def served(self, model: str = "add_sub") -> list[int]:
        """Successful inferences of `model` by each daemon, from its statistics (-1: not answering)."""
        return [served(d, model) for d in self.daemons]

    def stop(self) -> None:
        for daemon in self.daemons:  # all at once, a second signal ending each one's grace
            if daemon.proc.poll() is None:
                daemon.proc.send_signal(signal.SIGTERM)
                daemon.proc.send_signal(signal.SIGTERM)
        for daemon in self.daemons:
            daemon.stop()
            daemon.kill_group()


def served(daemon: RunningDaemon, model: str) -> int:
    try:
        stats = daemon.client.get_inference_statistics(model, as_json=True)
    except Exception:
        return -1
    return sum(int(s["inference_stats"]["success"].get("count", 0)) for s in stats.get("model_stats", []))


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("fleet")
    models.add_sub(root / "repo", dims=4)
    models.add_sub(root / "repo", name="big", dims=4)  # the model HAProxy routes to two daemons only
    fleet = Fleet(root / "repo", root)
    try:
        yield fleet
    finally:
        fleet.stop()


class Load:
    """`CALLERS` threads, each calling its own `make_call()` in a loop: successes counted, failures kept."""

    def __init__(self, make_call: Callable[[], Callable[[], None]]) -> None:
        self.ok = 0
        self.failures: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(make_call,)) for _ in range(CALLERS)]

    def _run(self, make_call: Callable[[], Callable[[], None]]) -> None:
        call = make_call()
        while not self._stop.is_set():
            try:
                call()
            except Exception as exc:
                with self._lock:
                    self.failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            else:
                with self._lock:
                    self.ok += 1

    def more(self, calls: int, timeout: float = 60) -> None:
        """Until `calls` more calls have succeeded."""
        target = self.ok + calls
        wait_for(lambda: self.ok >= target, timeout, f"{calls} more calls", interval=0.02)

    def __enter__(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)


def grpc_call(url: str, model: str = "add_sub", **client_args: object) -> Callable[[], Callable[[], None]]:
    def make_call() -> Callable[[], None]:
        client = grpcclient.InferenceServerClient(url, **client_args)  # type: ignore[arg-type]
        a = np.arange(4, dtype=np.float32).reshape(1, 4)
        inputs = [grpcclient.InferInput(n, [1, 4], "FP32") for n in ("INPUT0", "INPUT1")]
        for tensor in inputs:
            tensor.set_data_from_numpy(a)

        def call() -> None:
            out = client.infer(model, inputs, client_timeout=30).as_numpy("OUTPUT0")
            assert out is not None and out.tolist() == [[0.0, 2.0, 4.0, 6.0]], out

        return call

    return make_call


def http_call(address: str, model: str = "add_sub") -> Callable[[], Callable[[], None]]:
    def make_call() -> Callable[[], None]:
        def call() -> None:
            status, reply, _ = http_request(address, "POST", f"/v2/models/{model}/infer", BODY)
            assert status == 200, (status, reply)
            assert reply["outputs"][0]["data"] == [2.0, 3.0, 4.0, 5.0], reply

        return call

    return make_call


def balanced(
    fleet: Fleet, model: str = "add_sub", service: str = "", **args: Any
) -> Callable[[], Callable[[], None]]:
    """Calls through one channel to all three daemons: round_robin, health checks of `service`, retries."""
    target = balanced_target([d.address for d in fleet.daemons])
    return grpc_call(target, model, channel_args=balanced_channel_args(service=service, **args))


def every_daemon_serves(fleet: Fleet, before: list[int], model: str = "add_sub") -> None:
    """Until each daemon has served more of `model` than `before`: the load is spread over all three."""
    wait_for(  # up to two minutes: three daemons on 2 cores, beside the rest of the suite
        lambda: all(now > then for now, then in zip(fleet.served(model), before, strict=True)),
        120,
        f"every daemon serving {model}",
    )


def test_balanced_target_names_every_host() -> None:
    assert balanced_target(["127.0.0.1:1", "10.0.0.2:2"]) == "ipv4:127.0.0.1:1,10.0.0.2:2"
    assert balanced_target(["[::1]:1", "[fe80::2]:2"]) == "ipv6:[::1]:1,[fe80::2]:2"
    assert balanced_target(["mpsd.internal:8001"]) == "dns:///mpsd.internal:8001"
    for mixed in (["127.0.0.1:1", "[::1]:2"], ["a:1", "b:1"], ["127.0.0.1"], []):
        with pytest.raises(ValueError):
            balanced_target(mixed)


def test_a_balanced_channel_retries_unavailable_on_the_documented_methods_only() -> None:
    """docs/scale-out.md: ModelInfer and the read-only calls are retried on UNAVAILABLE (another daemon
    takes them); `methods=()` retries none."""
    import json

    config = json.loads(dict(balanced_channel_args())["grpc.service_config"])
    [methods] = config["methodConfig"]
    assert {n["method"] for n in methods["name"]} == {
        "ModelInfer",
        "ModelReady",
        "ModelMetadata",
        "ModelConfig",
        "ServerReady",
        "ServerMetadata",
    }
    assert methods["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]
    none = json.loads(dict(balanced_channel_args(methods=()))["grpc.service_config"])
    assert none["methodConfig"][0]["name"] == []


# ---- client-side balancing: the stock tritonclient with gRPC's round_robin, health checks, retries ---


def test_client_side_round_robin_spreads_over_every_daemon(fleet: Fleet) -> None:
    before = fleet.served()
    with Load(balanced(fleet)) as load:
        every_daemon_serves(fleet, before)
    assert load.failures == []


def test_client_side_sigterm_fails_no_request(fleet: Fleet) -> None:
    victim = fleet.daemons[1]
    try:
        with Load(balanced(fleet)) as load:
            every_daemon_serves(fleet, fleet.served())
            victim.proc.send_signal(signal.SIGTERM)
            assert victim.proc.wait(60) == 0
            load.more(40)
        assert load.failures == []
    finally:
        fleet.restart(1)


def test_client_side_kill_fails_no_request_and_the_others_take_its_share(fleet: Fleet) -> None:
    victim = fleet.daemons[2]
    try:
        with Load(balanced(fleet)) as load:
            every_daemon_serves(fleet, fleet.served())
            victim.kill_group()
            victim.proc.wait(60)
            others = fleet.served()[:2]
            load.more(40)
            after = fleet.served()[:2]
        assert load.failures == []  # the calls in flight on the dead daemon were retried on the others
        assert sum(after) - sum(others) >= 40
        assert all(a > o for a, o in zip(after, others, strict=True))
    finally:
        fleet.restart(2)


def test_client_side_health_check_per_model_skips_the_daemon_without_it(fleet: Fleet) -> None:
    """A channel that checks one model's health (its name as the service) sends that model's calls only to
    the daemons that serve it. No retries here: each call to the daemon without it would fail."""
    host = fleet.daemons[0]
    host.client.unload_model("big")
    try:
        with grpc.insecure_channel(host.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            with pytest.raises(grpc.RpcError) as unknown:
                health.Check(health_pb2.HealthCheckRequest(service="big"), timeout=10)
            assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        before = fleet.served("big")
        with Load(balanced(fleet, "big", service="big", methods=())) as load:
            load.more(60)
        assert load.failures == []
        after = fleet.served("big")
        assert after[0] == -1 and after[1] > before[1] and after[2] > before[2]
    finally:
        host.client.load_model("big")
        wait_for(lambda: host.client.is_model_ready("big"), 60, "big loaded again")


# ---- HAProxy: deploy/haproxy/mpsd.cfg, gRPC over HTTP/2 end to end, HTTP routed per model -----------


@pytest.fixture(scope="module")
def proxy(fleet: Fleet, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HAProxy]:
    if HAPROXY is None:
        pytest.skip(not_installed("haproxy"))
    daemons = [(d.address, d.http_address) for d in fleet.daemons]
    ports = (free_port(), free_port(), free_port())
    proxy = HAProxy(HAPROXY, daemons, tmp_path_factory.mktemp("haproxy"), ports=ports)
    try:
        proxy.wait_all_up(timeout_s=120)
        yield proxy
    finally:
        proxy.stop()


def test_haproxy_spreads_grpc_and_routes_http_per_model(fleet: Fleet, proxy: HAProxy) -> None:
    assert len(proxy.servers()) == 3 + 3 + 2  # mpsd_grpc, mpsd_http, mpsd_http_big
    before = fleet.served()
    with Load(grpc_call(proxy.grpc)) as load:
        every_daemon_serves(fleet, before)
    assert load.failures == []
    before = fleet.served()
    with Load(http_call(proxy.http)) as load:
        every_daemon_serves(fleet, before)
    assert load.failures == []
    before = fleet.served("big")
    with Load(http_call(proxy.http, "big")) as load:
        load.more(60)
    assert load.failures == []
    after = fleet.served("big")
    assert after[0] > before[0] and after[1] > before[1]
    assert after[2] == before[2], "a request for big reached the daemon HAProxy does not route it to"


def test_haproxy_sigterm_fails_no_request(fleet: Fleet, proxy: HAProxy) -> None:
    victim = fleet.daemons[0]
    try:
        with Load(grpc_call(proxy.grpc)) as grpc_load, Load(http_call(proxy.http)) as http_load:
            every_daemon_serves(fleet, fleet.served())
            victim.proc.send_signal(signal.SIGTERM)
            assert victim.proc.wait(60) == 0
            grpc_load.more(40)
            http_load.more(40)
        assert grpc_load.failures == []
        assert http_load.failures == []
    finally:
        fleet.restart(0)
        proxy.wait_all_up(timeout_s=120)


def test_haproxy_kill_fails_at_most_the_calls_in_flight(fleet: Fleet, proxy: HAProxy) -> None:
    victim = fleet.daemons[1]
    try:
        with Load(grpc_call(proxy.grpc)) as grpc_load, Load(http_call(proxy.http)) as http_load:
            every_daemon_serves(fleet, fleet.served())
            victim.kill_group()
            victim.proc.wait(60)
            wait_for(lambda: proxy.servers()[("mpsd_grpc", "mpsd2")] != "UP", 30, "mpsd2 DOWN in HAProxy")
            grpc_load.more(40)
            http_load.more(40)
        failed = {"gRPC": grpc_load.failures, "HTTP": http_load.failures}
        print(
            f"calls failed when a daemon was killed under HAProxy: { {k: len(v) for k, v in failed.items()} }"
        )
        print("\n".join(f"  {k}: {v[0]}" for k, v in failed.items() if v))
        # each caller has one call in flight at a time: at most that many were on the killed daemon
        assert len(grpc_load.failures) <= CALLERS, grpc_load.failures
        assert len(http_load.failures) <= CALLERS, http_load.failures
    finally:
        fleet.restart(1)
        proxy.wait_all_up(timeout_s=120)
