"""A python model's calls to other models in one process: the call handler (core/calls.py's `ModelCalls`)
behind a worker's call router (dataplane/calls.py's `CallRouter`) on a fake link to the worker (the router's
transport, whose frames are read back as the worker reads them), over step models that are fakes: a call's
answer, the called model's failure and a failed check as the client's error, a call past its deadline (the
called model's request cancelled), a stream's parts each after the worker took the one before, a stop from
the worker ending the called model's stream, and calls the router or handler refuses. What bounds a call
(its timeout, its execution's deadline, its batch) is test_call_bounds.py's; calls from real workers over
the wire are test_calls.py's."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core.calls import ModelCalls
from mpsd.daemon.dataplane.calls import CallRouter
from mpsd.daemon.dataplane.request import InferRequest, InferResult, OutputTensor
from mpsd.errors import ErrorCode, MpsdError, ResourceExhausted
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import recv_blocking

F2 = {"data_type": "TYPE_FP32", "dims": [2]}
ONE_TWO = np.array([1, 2], np.float32).tobytes()


def config(decoupled: bool = False) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", **F2}],
            "output": [{"name": "y", **F2}, {"name": "z", **F2}],
            "model_transaction_policy": {"decoupled": decoupled},
        }
    )


@dataclass
class Called:
    """A called model's plane: `answer` makes each response's outputs (None: it never answers); a stream
    gives `parts` responses, the i-th adding i to the input."""

    name: str
    answer: Callable[[np.ndarray], dict[str, np.ndarray]] | None = None
    parts: int = 3
    seen: list[InferRequest] = field(default_factory=list)
    cancelled: bool = False
    stream_closed_after: int | None = None

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        self.seen.append(request)
        if self.answer is None:
            try:
                await asyncio.get_running_loop().create_future()
            except asyncio.CancelledError:
                self.cancelled = True
                raise
        assert self.answer is not None
        x = np.frombuffer(bytes(request.inputs[0].data), np.float32)
        made = self.answer(x)
        return InferResult(
            self.name,
            1,
            tuple(
                OutputTensor(k, "FP32", (2,), v.tobytes()) for k, v in made.items() if k in request.outputs
            ),
        )

    async def stream(
        self, request: InferRequest, deadline: float | None = None
    ) -> AsyncGenerator[InferResult]:
        self.seen.append(request)
        x = np.frombuffer(bytes(request.inputs[0].data), np.float32)
        sent = 0
        try:
            for i in range(self.parts):
                sent += 1
                yield InferResult(self.name, 1, (OutputTensor("y", "FP32", (2,), (x + i).tobytes()),))
        finally:
            self.stream_closed_after = sent


@dataclass
class Version:
    name: str
    config: ModelConfig
    plane: Called
    version: int = 1


class Models:
    """The registry as calls use it."""

    def __init__(self, *versions: Version) -> None:
        self.versions = {v.name: v for v in versions}
        self.touched: list[str] = []

    async def acquire(self, name: str, version: str, deadline: float | None) -> Any:
        if name not in self.versions:
            raise MpsdError(f"Request for unknown model: '{name}' is not found", ErrorCode.NOT_FOUND)
        return self.versions[name]

    def touch(self, name: str) -> None:
        self.touched.append(name)

    def loads_first(self, name: str) -> bool:
        return False

    def model_available(self, name: str) -> bool:
        return name in self.versions


class Worker:
    """The worker's end of the channel: the router writes frames to `ours`, read back here as the worker
    reads them."""

    def __init__(self, models: Models) -> None:
        self.router = CallRouter(ModelCalls(models))
        self.ours, self.theirs = socket.socketpair()
        self.theirs.settimeout(10)
        self.router.transport = cast(Any, self)

    def write(self, data: bytes) -> None:
        self.ours.sendall(data)

    def is_closing(self) -> bool:
        return False

    async def next(self) -> object:
        return await asyncio.to_thread(recv_blocking, self.theirs)

    def execution(
        self,
        req_id: int = 1,
        model: str = "caller",
        deadline: float | None = None,
        chain: frozenset[tuple[str, int]] = frozenset(),
    ) -> None:
        """An execution of `model` version 1 sent to the worker, whose request came through `chain`."""
        self.router.begin(req_id, cast(Any, p.ModelSpec)(model, 1, "", "", 0, (), ()), chain, deadline, ())

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()


def call(call_id: int = 7, model: str = "called", stream: bool = False, **kw: Any) -> p.Call:
    x = kw.pop("x", p.CallTensor("x", "FP32", (2,), ONE_TWO))
    return p.Call(call_id, 1, model, "", (x,), stream=stream, **kw)


def run(models: Models, body: Callable[[Worker], Any]) -> Any:
    async def main() -> Any:
        worker = Worker(models)
        try:
            return await asyncio.wait_for(body(worker), 20)
        finally:
            worker.close()

    return asyncio.run(main())


def doubled(x: np.ndarray) -> dict[str, np.ndarray]:
    return {"y": x * 2, "z": x + 1}


def test_a_call_is_answered_with_the_called_models_outputs() -> None:
    models = Models(Version("called", config(), Called("called", doubled)))

    async def body(worker: Worker) -> object:
        worker.execution()
        worker.router.received(call(outputs=("y",)))
        return await worker.next()

    done = run(models, body)
    assert isinstance(done, p.CallDone) and done.call_id == 7
    [y] = done.outputs
    assert (y.name, y.datatype, y.shape) == ("y", "FP32", (2,))
    assert np.frombuffer(y.data, np.float32).tolist() == [2, 4]
    [request] = models.versions["called"].plane.seen
    assert request.outputs == ("y",) and models.touched == ["called"]


def test_a_call_naming_no_outputs_gets_every_output() -> None:
    models = Models(Version("called", config(), Called("called", doubled)))

    async def body(worker: Worker) -> object:
        worker.execution()
        worker.router.received(call())
        return await worker.next()

    done = run(models, body)
    assert isinstance(done, p.CallDone) and [o.name for o in done.outputs] == ["y", "z"]


def _failed(models: Models, made: p.Call) -> p.CallFailed:
    async def body(worker: Worker) -> object:
        worker.execution()
        worker.router.received(made)
        return await worker.next()

    failed = run(models, body)
    assert isinstance(failed, p.CallFailed) and failed.call_id == made.call_id, failed
    return failed


def test_the_called_models_failure_is_the_calls_with_its_status() -> None:
    def refuses(x: np.ndarray) -> dict[str, np.ndarray]:
        raise ResourceExhausted("the called model's queue is full")

    failed = _failed(Models(Version("called", config(), Called("called", refuses))), call())
    assert (failed.code, failed.message) == (
        ErrorCode.RESOURCE_EXHAUSTED.value,
        "the called model's queue is full",
    )


@pytest.mark.parametrize(
    ("made", "code", "says"),
    [
        (call(x=p.CallTensor("x", "FP32", (3,), bytes(12))), ErrorCode.INVALID_ARGUMENT, "shape [3]"),
        (
            call(x=p.CallTensor("x", "INT32", (2,), bytes(8))),
            ErrorCode.INVALID_ARGUMENT,
            "expected datatype FP32",
        ),
        (call(outputs=("w",)), ErrorCode.INVALID_ARGUMENT, "'w'"),
        (call(model="absent"), ErrorCode.NOT_FOUND, "'absent' is not found"),
        (call(model="caller"), ErrorCode.FAILED_PRECONDITION, "model 'caller' version 1 called itself"),
    ],
    ids=["shape", "datatype", "unknown output", "unknown model", "itself"],
)
def test_a_call_that_fails_its_checks_gets_the_clients_error(
    made: p.Call, code: ErrorCode, says: str
) -> None:
    called = Called("called", doubled)
    models = Models(
        Version("called", config(), called), Version("caller", config(), Called("caller", doubled))
    )
    failed = _failed(models, made)
    assert failed.code == code.value and says in failed.message, failed
    assert called.seen == []


def test_a_decoupled_model_must_be_called_as_a_stream() -> None:
    failed = _failed(Models(Version("called", config(decoupled=True), Called("called"))), call())
    assert failed.code == ErrorCode.UNIMPLEMENTED.value and "call it with models.stream" in failed.message


def test_a_call_past_its_deadline_fails_and_its_request_is_cancelled() -> None:
    called = Called("called", answer=None)  # never answers
    models = Models(Version("called", config(), called))

    async def body(worker: Worker) -> object:
        worker.execution(deadline=time.monotonic() + 0.05)
        worker.router.received(call())
        return await worker.next()

    failed = run(models, body)
    assert isinstance(failed, p.CallFailed) and failed.code == ErrorCode.DEADLINE_EXCEEDED.value
    assert failed.message == "call to model 'called': the deadline of the request to model 'caller' passed"
    assert called.cancelled


def test_a_call_whose_execution_ended_is_cancelled() -> None:
    called = Called("called", answer=None)
    models = Models(Version("called", config(), called))

    async def body(worker: Worker) -> object:
        worker.execution()
        worker.router.received(call())
        while not called.seen:
            await asyncio.sleep(0.01)
        worker.router.answered(1)  # the execution was answered: nothing waits for its calls
        return await worker.next()

    failed = run(models, body)
    assert isinstance(failed, p.CallFailed) and failed.code == ErrorCode.CANCELLED.value
    assert "the request to model 'caller' that made this call has ended" in failed.message
    assert called.cancelled


def test_a_call_from_no_execution_running_is_refused() -> None:
    models = Models(Version("called", config(), Called("called", doubled)))

    async def body(worker: Worker) -> object:
        worker.router.received(call())  # no execution 1 was sent: it ended, or never was
        return await worker.next()

    failed = run(models, body)
    assert isinstance(failed, p.CallFailed) and failed.code == ErrorCode.UNAVAILABLE.value
    assert failed.message == "call to model 'called' from a request that has ended"


def test_a_streamed_call_sends_each_part_once_the_worker_took_the_one_before() -> None:
    called = Called("called", parts=3)
    models = Models(Version("called", config(decoupled=True), called))

    async def body(worker: Worker) -> list[object]:
        worker.execution()
        worker.router.received(call(stream=True))
        got = []
        for _ in range(3):
            got.append(await worker.next())
            assert len(called.seen) == 1
            worker.router.received(p.CallAck(7))
        got.append(await worker.next())
        return got

    *parts, done = run(models, body)
    assert [type(m) for m in parts] == [p.CallPart] * 3 and done == p.CallDone(7)
    values = [np.frombuffer(m.outputs[0].data, np.float32).tolist() for m in cast(list[p.CallPart], parts)]
    assert values == [[1, 2], [2, 3], [3, 4]]
    assert called.stream_closed_after == 3


def test_the_workers_stop_ends_the_called_models_stream() -> None:
    called = Called("called", parts=100)
    models = Models(Version("called", config(decoupled=True), called))

    async def body(worker: Worker) -> object:
        worker.execution()
        worker.router.received(call(stream=True))
        first = await worker.next()
        worker.router.received(p.CallAck(7, stop=True))
        while called.stream_closed_after is None:
            await asyncio.sleep(0.01)
        return first

    assert isinstance(run(models, body), p.CallPart)
    assert called.stream_closed_after == 1  # not one response more was made


def test_a_streamed_call_to_a_model_that_is_not_decoupled_gets_its_one_answer_then_the_end() -> None:
    models = Models(Version("called", config(), Called("called", doubled)))

    async def body(worker: Worker) -> list[object]:
        worker.execution()
        worker.router.received(call(stream=True, outputs=("y",)))
        part = await worker.next()
        worker.router.received(p.CallAck(7))
        return [part, await worker.next()]

    part, done = run(models, body)
    assert isinstance(part, p.CallPart) and np.frombuffer(part.outputs[0].data, np.float32).tolist() == [2, 4]
    assert done == p.CallDone(7)


def test_a_call_back_to_a_version_its_request_came_through_is_refused() -> None:
    """An ensemble step or an earlier call made the request: calling back would wait for itself."""
    called = Called("called", doubled)
    models = Models(Version("called", config(), called))

    async def body(worker: Worker) -> object:
        worker.execution(chain=frozenset({("called", 1)}))
        worker.router.received(call())
        return await worker.next()

    failed = run(models, body)
    assert isinstance(failed, p.CallFailed) and failed.code == ErrorCode.FAILED_PRECONDITION.value
    assert "called model 'called' version 1, which its request came through" in failed.message, failed
    assert called.seen == []


def test_another_version_of_a_model_its_request_came_through_may_be_called() -> None:
    """docs/calling-models.md: only the versions on the path are refused; version 2 may call version 1."""
    called = Called("called", doubled)
    models = Models(Version("called", config(), called))  # the latest is version 1

    async def body(worker: Worker) -> object:
        worker.execution(chain=frozenset({("called", 2)}))
        worker.router.received(call(outputs=("y",)))
        return await worker.next()

    done = run(models, body)
    assert isinstance(done, p.CallDone), done
    assert len(called.seen) == 1


def test_a_called_models_outputs_past_what_a_call_carries_are_resource_exhausted() -> None:
    """docs/calling-models.md: a call's outputs travel inline, at most MAX_CALL_BYTES (60 MiB)."""
    big = Called("called", lambda x: {"y": np.zeros(p.MAX_CALL_BYTES // 4 + 1, np.float32)})
    failed = _failed(Models(Version("called", config(), big)), call(outputs=("y",)))
    assert failed.code == ErrorCode.RESOURCE_EXHAUSTED.value, failed
    assert f"a call carries at most {p.MAX_CALL_BYTES} bytes" in failed.message


def test_a_worker_whose_daemon_runs_no_calls_is_refused() -> None:
    async def body() -> object:
        router = CallRouter(None)
        worker = Worker(Models())
        router.transport = cast(Any, worker)
        try:
            router.begin(1, cast(Any, p.ModelSpec)("caller", 1, "", "", 0, (), ()), frozenset(), None, ())
            router.received(call())
            return await worker.next()
        finally:
            worker.close()

    failed = asyncio.run(body())
    assert isinstance(failed, p.CallFailed) and failed.code == ErrorCode.UNAVAILABLE.value
    assert failed.message == "call to model 'called' refused: this daemon runs no calls between models"
