"""The scenarios of test_known_headers.py, run in a fresh interpreter (`python -m
tests.known_headers_scenarios NAME`): the daemon's gRPC messages and tritonclient's share protobuf
package names, so they cannot be loaded in one process, and the test process has tritonclient's."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import mpsd.daemon.api.operations as operations
import mpsd.daemon.api.pipeline as pipeline
from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.grpc.front_calls import front_submit
from mpsd.daemon.api.grpc.inference import InferenceServicer
from mpsd.daemon.api.parse import MAX_ID, parse_infer_request
from mpsd.daemon.dataplane.request import InferRequest, InferResult, OutputTensor
from mpsd.errors import InvalidArgument, MpsdError
from mpsd.ipc.infer_wire import split_request
from mpsd.proto import grpc_service_pb2 as pb
from tests.fresh_interpreter import main

CONFIG = {
    "max_batch_size": 8,
    "input": [
        {"name": "a", "data_type": "TYPE_FP32", "dims": [4]},
        {"name": "b", "data_type": "TYPE_INT32", "dims": [2]},
    ],
    "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
}


class Version:
    """Stands in for a ModelVersion: answers with input `a` as `y` and keeps the requests it ran."""

    def __init__(self, config: ModelConfig) -> None:
        self.config = config
        self.plane = self  # its data plane's entry, `infer`
        self.ran: list[InferRequest] = []
        self.deadlines: list[float | None] = []  # of the requests submitted

    async def infer(self, request: InferRequest, deadline: float | None) -> InferResult:
        return self._run(request)

    def submit(
        self,
        request: InferRequest,
        deadline: float | None,
        then: Callable[[asyncio.Future[InferResult]], None],
    ) -> asyncio.Future[InferResult]:
        self.deadlines.append(deadline)
        future = asyncio.get_running_loop().create_future()
        future.add_done_callback(then)
        future.set_result(self._run(request))
        return future

    def _run(self, request: InferRequest) -> InferResult:
        self.ran.append(request)
        a = request.inputs[0]
        return InferResult("m", 1, (OutputTensor("y", "FP32", a.shape, bytes(a.data)),))  # type: ignore[arg-type]


class Registry:
    """Stands in for the registry: one model, `m`, whose version can be swapped (a reload)."""

    def __init__(self) -> None:
        self.version = Version(ModelConfig.model_validate(CONFIG))

    async def acquire(self, name: str, version: str, deadline: float | None) -> Version:
        return self.acquire_running(name, version)

    def acquire_running(self, name: str, version: str) -> Version:
        assert name == "m"
        return self.version

    def loads_first(self, name: str) -> bool:
        return False

    def touch(self, name: str) -> None:
        pass


def counted_parses() -> list[str]:
    """The requests (by id) that go through the full parse and checks from now on."""
    seen: list[str] = []
    full = parse_infer_request

    def counting(call: Any, *args: Any, **kwargs: Any) -> InferRequest:
        seen.append(call.id)
        return full(call, *args, **kwargs)

    pipeline.parse_infer_request = counting  # type: ignore[attr-defined]
    return seen


def request(a: np.ndarray, b_bytes: bytes | None = None, rid: str = "", **params: int) -> bytes:
    message = pb.ModelInferRequest(model_name="m", id=rid)
    for name, datatype, shape in (("a", "FP32", a.shape), ("b", "INT32", (a.shape[0], 2))):
        tensor = message.inputs.add(name=name, datatype=datatype)
        tensor.shape.extend(shape)
    for key, value in params.items():
        message.parameters[key].int64_param = value
    message.raw_input_contents.append(a.astype(np.float32).tobytes())
    message.raw_input_contents.append(b_bytes if b_bytes is not None else bytes(8 * a.shape[0]))
    data: bytes = message.SerializeToString()
    return data


def answer(servicer: InferenceServicer, data: bytes) -> tuple[str, np.ndarray]:
    parts = asyncio.run(servicer.infer_serialized_parts(data, None))
    response = pb.ModelInferResponse.FromString(b"".join(bytes(p) for p in parts))
    return response.id, np.frombuffer(response.raw_output_contents[0], np.float32)


def servicer(registry: Registry) -> InferenceServicer:
    return InferenceServicer(operations.Operations(registry, lambda: False))  # type: ignore[arg-type]


def known_header_skips_the_parse() -> None:
    parses = counted_parses()
    registry = Registry()
    api = servicer(registry)
    rows = [np.full((1, 4), k, np.float32) for k in range(3)]
    ids = ["r", "s", ""]  # the id is not part of the key: each request keeps its own
    answers = [answer(api, request(x, rid=rid)) for x, rid in zip(rows, ids, strict=True)]
    assert parses == ["r"], "only the first request was parsed and checked"
    for (rid, y), x, sent in zip(answers, rows, ids, strict=True):
        assert rid == sent and y.tolist() == x.ravel().tolist()
    assert [r.id for r in registry.version.ran] == ids
    assert [r.inputs[1].shape for r in registry.version.ran] == [(1, 2)] * 3


def other_bytes_a_reload_and_parameters_take_the_full_path() -> None:
    parses = counted_parses()
    registry = Registry()
    api = servicer(registry)
    x = np.ones((1, 4), np.float32)
    answer(api, request(x, rid="1"))
    answer(api, request(np.ones((2, 4), np.float32), rid="2"))  # another shape: other header bytes
    assert parses == ["1", "2"]
    registry.version = Version(ModelConfig.model_validate(CONFIG))  # reloaded: a new config
    answer(api, request(x, rid="3"))
    assert parses == ["1", "2", "3"]
    answer(api, request(x, rid="t", timeout=10_000_000))
    answer(api, request(x, rid="t", timeout=10_000_000))  # a timeout counts from now: never learned
    assert parses[-2:] == ["t", "t"]


def bytes_that_do_not_fit_get_the_full_paths_error() -> None:
    parses = counted_parses()
    api = servicer(Registry())
    x = np.ones((1, 4), np.float32)
    answer(api, request(x, rid="k"))
    for bad, message in (
        (request(x, b_bytes=bytes(4), rid="k"), "input 'b': raw content has 4 bytes, expected 8"),
        (request(x, rid="i" * (MAX_ID + 1)), f"request id is {MAX_ID + 1} characters long"),
    ):
        try:
            answer(api, bad)
        except InvalidArgument as exc:
            assert message in exc.message, exc.message
        else:
            raise AssertionError(f"accepted: {message}")
    assert len(parses) == 3


def outcome(servicer: InferenceServicer, data: bytes) -> tuple[str, object]:
    """What the client gets: the response's id and outputs, or the error's code and message."""
    try:
        rid, y = answer(servicer, data)
    except MpsdError as exc:
        return ("error", (exc.code.value, exc.message))
    return ("ok", (rid, y.tolist()))


Answer = Callable[[InferenceServicer, bytes], tuple[str, object]]  # `outcome`, or a front call's


def answers_as_the_full_path(answer: Answer) -> None:
    """Property: a sequence of requests (shapes, ids, raw sizes that fit or not, some with a timeout
    parameter) gets the same answers and errors, in the same order, from a servicer that learns headers
    (each request answered by `answer`) as from one that never does (every request parsed and checked in
    full)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    requests = st.lists(
        st.tuples(
            st.integers(1, 3),  # rows of a
            st.sampled_from([None, 4, 8, 16]),  # bytes of b (None: the right size)
            st.sampled_from(["", "r", "s", "i" * (MAX_ID + 1)]),  # ids, one too long
            st.booleans(),  # a timeout parameter: never learned
        ),
        min_size=1,
        max_size=12,
    )

    @settings(max_examples=60, deadline=None)
    @given(requests)
    def same(sequence: list[tuple[int, int | None, str, bool]]) -> None:
        learning, plain = servicer(Registry()), servicer(Registry())
        plain.known.learner = lambda *args: None  # type: ignore[method-assign]
        for k, (rows, b_size, rid, timeout) in enumerate(sequence):
            a = np.full((rows, 4), k, np.float32)
            b = bytes(b_size) if b_size is not None else None
            data = request(a, b, rid, **({"timeout": 10_000_000} if timeout else {}))
            assert answer(learning, data) == outcome(plain, data), (k, sequence)
        assert len(plain.known) == 0

    same()


def known_path_answers_as_the_full_path() -> None:
    answers_as_the_full_path(outcome)


def submitted_outcome(
    servicer: InferenceServicer, data: bytes, submitted: list[str], deadline: float | None = None
) -> tuple[str, object]:
    """`outcome` as a front's call gets it: submitted where its header is known (`front_submit`, its id
    added to `submitted`), through the servicer's bytes path where it is not."""
    submit = front_submit(servicer)

    async def parts() -> Sequence[bytes | memoryview]:
        split = split_request(data)
        answered: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future = submit(split, deadline, answered.set_result) if split is not None else None
        if future is None:
            return await servicer.infer_serialized_parts(data, deadline)
        submitted.append(pb.ModelInferRequest.FromString(data).id)
        call = await answered  # what the front's link is handed once the call is answered
        assert call.future is future
        return call.parts()

    try:
        response = pb.ModelInferResponse.FromString(b"".join(bytes(p) for p in asyncio.run(parts())))
    except MpsdError as exc:
        return ("error", (exc.code.value, exc.message))
    return ("ok", (response.id, np.frombuffer(response.raw_output_contents[0], np.float32).tolist()))


def submitted_calls_answer_as_the_full_path() -> None:
    """`answers_as_the_full_path` for a front's calls: the calls whose header is known by then are
    submitted, not run in a task, and answer as the full path does."""
    submitted: list[str] = []
    answers_as_the_full_path(lambda api, data: submitted_outcome(api, data, submitted))
    assert submitted, "no call was ever submitted"
    # The first request of a header is parsed and learned; the next with its bytes is submitted.
    first: list[str] = []
    registry = Registry()
    api = servicer(registry)
    x = np.ones((1, 4), np.float32)
    assert submitted_outcome(api, request(x, rid="1"), first)[0] == "ok" and first == []
    assert submitted_outcome(api, request(x, rid="2"), first, 1e9) == ("ok", ("2", [1.0] * 4))
    assert first == ["2"] and registry.version.deadlines == [1e9]  # it queues with the client's deadline


SCENARIOS: dict[str, Callable[[], None]] = {
    "skips": known_header_skips_the_parse,
    "full-path": other_bytes_a_reload_and_parameters_take_the_full_path,
    "sizes": bytes_that_do_not_fit_get_the_full_paths_error,
    "property": known_path_answers_as_the_full_path,
    "submitted": submitted_calls_answer_as_the_full_path,
}

if __name__ == "__main__":
    main(SCENARIOS)
