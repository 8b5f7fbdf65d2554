"""The inference pipeline in one process (api/pipeline.py through `Operations`), over a registry that is a
fake and model versions whose data planes are fakes answering `infer`/`stream`: a call reaches the version
it names, a call that fails its checks never reaches a plane and gets the client's error, a model that
loads on demand is loaded by a call with a known header, a live sequence's requests go on to the version
being replaced, and outputs bound to a client's shared memory are written there. The wire (tritonclient,
gRPC and HTTP) is test_infer.py's; classification and the response cache have modules of their own."""

from __future__ import annotations

import _posixshmem
import asyncio
import mmap
import os
import secrets
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall, InputCall, OutputCall, Param
from mpsd.daemon.api.client_shm import ClientShmRegistry
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.parse import parse_infer_request
from mpsd.daemon.core.response_cache import ResponseCache
from mpsd.daemon.core.rollout import ModelEntry
from mpsd.daemon.dataplane.request import InferRequest, InferResult, OutputTensor
from mpsd.daemon.dataplane.stats import VersionStats
from mpsd.errors import ErrorCode, MpsdError, Unavailable
from tests import posix_shm


def config(
    dims: list[int], datatype: str = "TYPE_FP32", max_batch_size: int = 0, **extra: Any
) -> ModelConfig:
    tensor = {"data_type": datatype, "dims": dims}
    return ModelConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": max_batch_size,
            "input": [{"name": "x", **tensor}],
            "output": [{"name": "y", **tensor}],
            **extra,
        }
    )


@dataclass
class Plane:
    """A version's data plane: it records each request and answers its input back as every output (each
    response of a stream adds the response's number to the input's first byte)."""

    name: str
    version: int
    seen: list[InferRequest] = field(default_factory=list)
    live: set[object] = field(default_factory=set)  # sequence ids this plane holds
    closed: list[int] = field(default_factory=list)

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        self.seen.append(request)
        data = bytes(cast(bytes, request.inputs[0].data))
        outs = tuple(
            OutputTensor(n, request.inputs[0].datatype, request.inputs[0].shape, data)
            for n in request.outputs
        )
        return InferResult(self.name, self.version, outs)

    async def stream(
        self, request: InferRequest, deadline: float | None = None
    ) -> AsyncGenerator[InferResult]:
        self.seen.append(request)
        data = bytes(cast(bytes, request.inputs[0].data))
        i = 0
        try:
            while True:
                i += 1
                part = bytes([(data[0] + i) % 256]) + data[1:]
                yield InferResult(
                    self.name,
                    self.version,
                    (OutputTensor("y", request.inputs[0].datatype, request.inputs[0].shape, part),),
                )
        finally:
            self.closed.append(i)

    def holds(self, request: InferRequest) -> bool:
        return request.sequence is not None and request.sequence.corrid in self.live


class Version:
    """A model version as the pipeline uses it."""

    def __init__(
        self, name: str, version: int, cfg: ModelConfig, fingerprint: object = "f1", labels: Any = None
    ) -> None:
        self.name, self.version, self.config = name, version, cfg
        self.plane = Plane(name, version)
        self.labels = labels or {}
        self.fingerprint = fingerprint
        self.stats = VersionStats()

    @property
    def label(self) -> str:
        return f"{self.name}/{self.version}"


class Registry:
    """The registry as the pipeline uses it: models by name, each with versions; `cold` ones are not running
    (`acquire` loads them, `acquire_running` refuses them), as a model that loads on demand."""

    def __init__(self, *versions: Version) -> None:
        self.entries: dict[str, ModelEntry] = {}
        self.served: dict[str, dict[int, Version]] = {}
        self.cold: set[str] = set()
        self.loads: list[str] = []
        self.touched: list[str] = []
        for v in versions:
            self.add(v)

    def add(self, v: Version) -> None:
        self.served.setdefault(v.name, {})[v.version] = v
        self.entries.setdefault(v.name, ModelEntry(v.name)).versions[v.version] = cast(Any, v)

    def _pick(self, name: str, version: str) -> Version:
        served = self.served.get(name)
        if not served:
            raise Unavailable(f"no model '{name}'")
        return served[int(version)] if version else served[max(served)]

    async def acquire(self, name: str, version: str, deadline: float | None) -> Version:
        if name in self.cold:
            self.loads.append(name)
            self.cold.discard(name)
        return self._pick(name, version)

    def acquire_running(self, name: str, version: str) -> Version:
        if name in self.cold:
            raise Unavailable(f"model '{name}' is not running")
        return self._pick(name, version)

    def loads_first(self, name: str) -> bool:
        return name in self.cold

    def route(self, name: str, version: str) -> Version:
        return self._pick(name, version)

    def touch(self, name: str) -> None:
        self.touched.append(name)


def f32(*values: float) -> bytes:
    return np.array(values, dtype=np.float32).tobytes()


def call(
    model: str = "m",
    data: bytes = f32(1, 2, 3, 4),
    shape: tuple[int, ...] = (4,),
    datatype: str = "FP32",
    version: str = "",
    name: str = "x",
    params: dict[str, Param] | None = None,
    outputs: tuple[OutputCall, ...] = (),
) -> InferCall:
    return InferCall(model, version, "r", params or {}, (InputCall(name, datatype, shape),), outputs, (data,))


def infer(ops: Operations, c: InferCall) -> Any:
    return asyncio.run(ops.infer(c))


def ops_over(*versions: Version, **kwargs: Any) -> tuple[Operations, Registry]:
    reg = Registry(*versions)
    return Operations(cast(Any, reg), lambda: False, **kwargs), reg


def test_a_call_runs_on_the_version_it_names_and_gets_its_answer() -> None:
    one, two = Version("m", 1, config([4])), Version("m", 2, config([4]))
    ops, reg = ops_over(one, two)
    answered = infer(ops, call(version="1", data=f32(1, 2, 3, 4)))
    assert (answered.result.model, answered.result.version) == ("m", 1)
    assert answered.result.outputs[0].data == f32(1, 2, 3, 4) and answered.in_shm == frozenset()
    [request] = one.plane.seen
    assert request.inputs[0].shape == (4,) and request.outputs == ("y",) and not two.plane.seen
    infer(ops, call())  # no version: the registry's choice, the newest here
    assert len(two.plane.seen) == 1 and reg.touched == ["m", "m"]


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (
            call(shape=(5,), data=f32(1, 2, 3, 4, 5)),
            "input 'x': shape [5] does not match the model's dims [4]",
        ),
        (call(datatype="INT32"), "input 'x': expected datatype FP32, got 'INT32'"),
        (call(name="w"), "unknown input 'w' for model 'm' (expected: x)"),
        (InferCall("m", "", "r"), "missing input(s) x for model 'm'"),
        (call(data=f32(1, 2, 3)), "input 'x': raw content has 12 bytes, expected 16 for shape [4] of FP32"),
    ],
    ids=["shape", "datatype", "unknown input", "missing input", "byte size"],
)
def test_a_call_that_fails_its_checks_gets_invalid_argument_and_never_reaches_the_plane(
    bad: InferCall, says: str
) -> None:
    mv = Version("m", 1, config([4]))
    ops, reg = ops_over(mv)
    with pytest.raises(MpsdError) as raised:
        infer(ops, bad)
    assert raised.value.code == ErrorCode.INVALID_ARGUMENT
    assert says in raised.value.message, raised.value.message
    assert mv.plane.seen == [] and reg.touched == ["m"]


def test_an_unknown_models_error_is_the_registrys() -> None:
    ops, _ = ops_over(Version("m", 1, config([4])))
    with pytest.raises(Unavailable, match="no model 'other'"):
        infer(ops, call("other"))


def test_a_decoupled_model_is_refused_a_unary_call_and_streams_instead() -> None:
    mv = Version("d", 1, config([2], "TYPE_UINT8", model_transaction_policy={"decoupled": True}))
    ops, _ = ops_over(mv)
    with pytest.raises(MpsdError) as raised:
        infer(ops, call("d", data=bytes([10, 20]), shape=(2,), datatype="UINT8"))
    assert (
        raised.value.code == ErrorCode.UNIMPLEMENTED
        and "call it with ModelStreamInfer" in raised.value.message
    )
    assert mv.plane.seen == [] and ops.decoupled("d", "")

    async def three() -> list[bytes]:
        responses = ops.stream(call("d", data=bytes([10, 20]), shape=(2,), datatype="UINT8"))
        got = [bytes(cast(bytes, (await anext(responses)).result.outputs[0].data)) for _ in range(3)]
        await responses.aclose()  # the client is done: the model's stream is closed at its next
        assert mv.plane.closed == [3]
        return got

    assert asyncio.run(three()) == [bytes([11, 20]), bytes([12, 20]), bytes([13, 20])]


def test_a_model_that_loads_on_demand_is_loaded_by_a_call_with_a_known_header() -> None:
    """The known-header path skips the repository lookup for a running model, not a cold one."""
    mv = Version("m", 1, config([4]))
    ops, reg = ops_over(mv)
    reg.cold.add("m")

    def bind(cfg: ModelConfig) -> InferRequest:
        return parse_infer_request(call(), cfg)

    answered = asyncio.run(ops.infer_checked("m", "", bind, None))
    assert answered is not None and answered.result.outputs[0].data == f32(1, 2, 3, 4)
    assert reg.loads == ["m"] and len(mv.plane.seen) == 1
    assert asyncio.run(ops.infer_checked("m", "", bind, None)) is not None and reg.loads == ["m"]


def test_a_live_sequences_requests_go_on_to_the_version_being_replaced() -> None:
    cfg = config([1], max_batch_size=2, sequence_batching={})
    old, new = Version("s", 1, cfg, "old"), Version("s", 1, cfg, "new")
    ops, reg = ops_over(new)
    reg.entries["s"].retiring.append(cast(Any, old))
    old.plane.live.add(7)

    def step(sequence: int, start: bool) -> Any:
        params = {"sequence_id": Param("uint64", sequence), "sequence_start": Param("bool", start)}
        return call("s", f32(1), (1, 1), params=params)

    infer(ops, step(7, start=False))  # sequence 7 began on the old version: it ends there
    infer(ops, step(8, start=False))  # not live on the old one
    infer(ops, step(7, start=True))  # a new sequence 7 starts on the new version
    assert [r.sequence.corrid for r in old.plane.seen if r.sequence] == [7]
    assert [(r.sequence.corrid, r.sequence.start) for r in new.plane.seen if r.sequence] == [
        (8, False),
        (7, True),
    ]


@pytest.fixture
def region() -> Iterator[tuple[ClientShmRegistry, str]]:
    key = posix_shm.checked(f"/mpsd_pipe_{secrets.token_hex(4)}")

    fd = _posixshmem.shm_open(key, os.O_CREAT | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, 64)
    finally:
        os.close(fd)
    registry = ClientShmRegistry()
    registry.register("out", key, 0, 64)
    try:
        yield registry, key
    finally:
        registry.unregister("")
        posix_shm.unlink(key)


def _shm_output(offset: int, size: int) -> OutputCall:
    return OutputCall(
        "y",
        {
            "shared_memory_region": Param("string", "out"),
            "shared_memory_offset": Param("int64", offset),
            "shared_memory_byte_size": Param("int64", size),
        },
    )


def _read(key: str, offset: int, size: int) -> bytes:

    fd = _posixshmem.shm_open(key, os.O_RDONLY, 0)
    try:
        with mmap.mmap(fd, 64, prot=mmap.PROT_READ) as m:
            return m[offset : offset + size]
    finally:
        os.close(fd)


def test_an_output_bound_to_shared_memory_is_written_there(region: tuple[ClientShmRegistry, str]) -> None:
    shm, key = region
    ops, _ = ops_over(Version("m", 1, config([4])), client_shm=shm)
    answered = infer(ops, call(data=f32(5, 6, 7, 8), outputs=(_shm_output(16, 16),)))
    assert answered.in_shm == frozenset({"y"})
    assert _read(key, 16, 16) == f32(5, 6, 7, 8)


def test_an_output_larger_than_its_shared_memory_is_refused(region: tuple[ClientShmRegistry, str]) -> None:
    shm, _ = region
    mv = Version("m", 2, config([-1]))
    ops, _ = ops_over(mv, client_shm=shm)
    with pytest.raises(MpsdError) as raised:  # the size is the model's to say: known once it answers
        infer(ops, call(data=f32(1, 2, 3, 4, 5, 6), shape=(6,), outputs=(_shm_output(0, 16),)))
    assert raised.value.code == ErrorCode.INVALID_ARGUMENT
    assert "its shared memory holds 16 bytes but the result has 24 bytes" in raised.value.message
    assert len(mv.plane.seen) == 1


def test_a_stream_writes_each_response_to_shared_memory(region: tuple[ClientShmRegistry, str]) -> None:
    shm, key = region
    mv = Version("d", 1, config([2], "TYPE_UINT8", model_transaction_policy={"decoupled": True}))
    ops, _ = ops_over(mv, client_shm=shm)

    async def two() -> list[bytes]:
        got = []
        responses = ops.stream(call("d", bytes([1, 9]), (2,), "UINT8", outputs=(_shm_output(8, 2),)))
        for _ in range(2):
            answered = await anext(responses)
            assert answered.in_shm == frozenset({"y"})
            got.append(_read(key, 8, 2))
        await responses.aclose()
        return got

    assert asyncio.run(two()) == [bytes([2, 9]), bytes([3, 9])]


def test_the_response_cache_is_used_only_for_a_model_that_enables_it() -> None:
    """The cache's own behaviour through the pipeline is test_response_cache.py's; here: off by default."""
    mv = Version("m", 1, config([4]))
    ops, _ = ops_over(mv, response_cache=ResponseCache(1 << 20))
    for _ in range(2):
        infer(ops, call())
    assert len(mv.plane.seen) == 2 and mv.stats.cache_hit.count == 0


def test_a_check_of_the_name_comes_first() -> None:
    ops, _ = ops_over(Version("m", 1, config([4])))
    with pytest.raises(MpsdError) as raised:
        infer(ops, call(""))
    assert raised.value.code == ErrorCode.INVALID_ARGUMENT
