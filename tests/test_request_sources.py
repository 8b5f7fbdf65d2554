"""A request means the same whatever its source: a client's call (gRPC, HTTP, OpenAI's API and /generate
all read theirs into one `InferCall`), a ModelInfer whose header is known, a python model's call to another
model, and an ensemble's step. Each source is driven through its real path (Operations, the known-header
binder, ModelCalls, EnsemblePlane) in one process, over a fake registry whose model `m` records what
reaches its plane; one test per property, each over every source that can express it (a model's call
carries a timeout but no priority and no parameters: the worker's call API has neither).
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall, InputCall, Param
from mpsd.daemon.api.grpc.known_headers import KnownHeaders, known_header
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.parse import parse_infer_request
from mpsd.daemon.core.calls import ModelCalls
from mpsd.daemon.core.ensemble import EnsemblePlane
from mpsd.daemon.dataplane.calls import Caller, CallLink
from mpsd.daemon.dataplane.request import InferRequest, InferResult, OutputTensor
from mpsd.ipc import protocol as p

F4 = {"data_type": "TYPE_FP32", "dims": [1]}
X = struct.pack("<f", 1.0)
FAR = 10_000.0  # seconds: a client deadline later than any timeout here
TIMEOUT_US = 5_000_000


def target(*, cache: bool = False, override: bool = False) -> ModelConfig:
    """The model every source reaches: a python model (it reads its own parameters) with priority levels."""
    policy = {"allow_timeout_override": override, "timeout_action": "DELAY"}
    return ModelConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 8,
            "input": [{"name": "x", **F4}],
            "output": [{"name": "y", **F4}],
            "dynamic_batching": {
                "priority_levels": 4,
                "default_priority_level": 4,
                "default_queue_policy": policy,
            },
            "response_cache": {"enable": cache},
        }
    )


ENSEMBLE = ModelConfig.model_validate(
    {
        "backend": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "X", **F4}],
        "output": [{"name": "Y", **F4}],
        "ensemble_scheduling": {
            "step": [{"model_name": "m", "input_map": {"x": "X"}, "output_map": {"y": "Y"}}]
        },
    }
)


@dataclass
class Recorder:
    """Model `m`'s plane: it records each request and the deadline it queues with, and answers zeros."""

    seen: list[tuple[InferRequest, float | None]] = field(default_factory=list)

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        self.seen.append((request, deadline))
        outputs = tuple(OutputTensor(n, "FP32", (request.batch_size, 1), bytes(4)) for n in request.outputs)
        return InferResult(request.model, 1, outputs)


class Registry:
    """The registry as the sources use it: `m`, and the ensemble `ens` whose one step is `m`."""

    def __init__(self, config: ModelConfig) -> None:
        self.plane = Recorder()
        self.versions = {"m": self._version("m", config, self.plane)}
        ensemble = EnsemblePlane("ens", 1, ENSEMBLE, cast(Any, self))
        ensemble.closed = None
        self.versions["ens"] = self._version("ens", ENSEMBLE, ensemble)

    @staticmethod
    def _version(name: str, config: ModelConfig, plane: object) -> SimpleNamespace:
        return SimpleNamespace(
            name=name, version=1, config=config, plane=plane, label=f"{name}/1", labels=None
        )

    async def acquire(self, name: str, version: str, deadline: float | None) -> Any:
        return self.versions[name]

    def acquire_running(self, name: str, version: str) -> Any:
        return self.versions[name]

    def loads_first(self, name: str) -> bool:
        return False

    def touch(self, name: str) -> None:
        pass

    def model_available(self, name: str) -> bool:
        return True


def params(priority: int, timeout_us: int, own: dict[str, float]) -> dict[str, Param]:
    given = {k: Param("double", v) for k, v in own.items()}
    if priority:
        given["priority"] = Param("uint64", priority)
    if timeout_us:
        given["timeout"] = Param("int64", timeout_us)
    return given


def client_call(model: str, given: dict[str, Param]) -> InferCall:
    name = "x" if model == "m" else "X"
    return InferCall(model, "", "r", given, (InputCall(name, "FP32", (1, 1)),), (), (X,))


Source = Callable[[Registry, int, int, dict[str, float], float | None], Coroutine[Any, Any, None]]


async def by_client(
    reg: Registry, priority: int, timeout_us: int, own: dict[str, float], client: float | None
) -> None:
    ops = Operations(cast(Any, reg), lambda: False)
    await ops.infer(client_call("m", params(priority, timeout_us, own)), client)


async def by_known_header(
    reg: Registry, priority: int, timeout_us: int, own: dict[str, float], client: float | None
) -> None:
    """A header learned from a checked call, then bound to new bytes."""
    call = client_call("m", params(priority, timeout_us, own))
    config = reg.versions["m"].config
    known = known_header(call, parse_infer_request(call, config), config)
    bind = KnownHeaders().binder(known, b"header", (X,), "r2")
    assert await Operations(cast(Any, reg), lambda: False).infer_checked("m", "", bind, client) is not None


async def by_model_call(
    reg: Registry, priority: int, timeout_us: int, own: dict[str, float], client: float | None
) -> None:
    """A python model's call (it can say its timeout only); it must have been answered."""
    sent: list[object] = []
    call = p.Call(
        1, 1, "m", "", (p.CallTensor("x", "FP32", (1, 1), X),), timeout_us=timeout_us, request_id="r"
    )
    await ModelCalls(cast(Any, reg))(call, Caller("caller", 1, frozenset(), client), CallLink(1, sent.append))
    assert [type(m) for m in sent] == [p.CallDone], sent


async def by_ensemble_step(
    reg: Registry, priority: int, timeout_us: int, own: dict[str, float], client: float | None
) -> None:
    ops = Operations(cast(Any, reg), lambda: False)
    await ops.infer(client_call("ens", params(priority, timeout_us, own)), client)


EVERY: dict[str, Source] = {
    "client": by_client,
    "known header": by_known_header,
    "model call": by_model_call,
    "ensemble step": by_ensemble_step,
}
WITH_TERMS = {k: v for k, v in EVERY.items() if k != "model call"}  # priority and parameters


def reach(
    source: Source,
    config: ModelConfig,
    priority: int = 0,
    timeout_us: int = 0,
    own: dict[str, float] | None = None,
    client: float | None = None,
) -> tuple[InferRequest, float | None]:
    """What reached model `m`'s plane from `source`: the request and the deadline it queues with."""
    reg = Registry(config)
    asyncio.run(source(reg, priority, timeout_us, own or {}, client))
    (seen,) = reg.plane.seen
    return seen


@pytest.mark.parametrize("source", WITH_TERMS.values(), ids=WITH_TERMS.keys())
def test_the_priority_is_the_requests_own_whatever_the_source(source: Source) -> None:
    request, _ = reach(source, target(), priority=2)
    assert request.priority == 2


@pytest.mark.parametrize("source", WITH_TERMS.values(), ids=WITH_TERMS.keys())
def test_the_model_gets_its_own_parameters_and_never_the_servers_whatever_the_source(source: Source) -> None:
    request, _ = reach(source, target(), priority=2, timeout_us=TIMEOUT_US, own={"temperature": 0.5})
    assert request.parameters == (("temperature", 0.5),)


@pytest.mark.parametrize("override", [False, True], ids=["timeout bounds", "timeout overrides the level's"])
@pytest.mark.parametrize("source", EVERY.values(), ids=EVERY.keys())
def test_the_deadline_follows_one_rule_whatever_the_source(source: Source, override: bool) -> None:
    """The earlier of the client's deadline and the timeout from arrival; only the client's where the
    level lets the timeout override its own (the queue applies it then). Bounds, not timings: the timeout
    counts from a moment between `before` and `after`."""
    client = time.monotonic() + FAR
    before = time.monotonic()
    request, deadline = reach(source, target(override=override), timeout_us=TIMEOUT_US, client=client)
    after = time.monotonic()
    assert request.timeout_us == TIMEOUT_US
    if override:
        assert deadline == client
    else:
        assert deadline is not None and before + TIMEOUT_US / 1e6 <= deadline <= after + TIMEOUT_US / 1e6


@pytest.mark.parametrize("enabled", [False, True], ids=["cache off", "cache on"])
@pytest.mark.parametrize("source", EVERY.values(), ids=EVERY.keys())
def test_the_response_cache_may_answer_whatever_the_source_when_the_model_enables_it(
    source: Source, enabled: bool
) -> None:
    request, _ = reach(source, target(cache=enabled))
    assert request.cacheable is enabled
