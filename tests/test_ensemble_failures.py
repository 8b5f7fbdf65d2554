"""An ensemble whose step fails, in one process (core/ensemble.py) on step models that are fakes: the
request fails with the failing step named and that step's own status code (not INTERNAL), and the steps
still running are cancelled."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core.ensemble import EnsemblePlane
from mpsd.daemon.dataplane.request import InferRequest, InferResult, InputTensor, OutputTensor
from mpsd.errors import ErrorCode, InvalidArgument, MpsdError, NotFound, ResourceExhausted

F4 = {"data_type": "TYPE_FP32", "dims": [4]}
# Two independent steps from X, joined by a third.
ENSEMBLE = {
    "name": "branches",
    "backend": "ensemble",
    "max_batch_size": 0,
    "input": [{"name": "X", **F4}],
    "output": [{"name": "OUT", **F4}],
    "ensemble_scheduling": {
        "step": [
            {"model_name": "slow", "input_map": {"x": "X"}, "output_map": {"y": "a"}},
            {"model_name": "failing", "input_map": {"x": "X"}, "output_map": {"y": "b"}},
            {"model_name": "join", "input_map": {"a": "a", "b": "b"}, "output_map": {"y": "OUT"}},
        ]
    },
}


def _model_config(name: str, inputs: tuple[str, ...]) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": n, **F4} for n in inputs],
            "output": [{"name": "y", **F4}],
        }
    )


class SlowPlane:
    """A step that runs until it is cancelled, and says so."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = False

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        self.started.set()
        try:
            await asyncio.get_running_loop().create_future()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        raise AssertionError("unreachable")


class FailingPlane:
    """A step that fails with `error` once the slow step is running."""

    def __init__(self, slow: SlowPlane, error: MpsdError) -> None:
        self.slow = slow
        self.error = error

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        await self.slow.started.wait()
        raise self.error


class JoinPlane:
    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        data = request.inputs[0].data
        return InferResult("join", 1, (OutputTensor("y", "FP32", (4,), bytes(data)),))


@dataclass
class FakeVersion:
    name: str
    config: ModelConfig
    plane: Any
    version: int = 1


@dataclass
class StepModels:
    versions: dict[str, FakeVersion] = field(default_factory=dict)

    async def acquire(self, name: str, version: str, deadline: float | None) -> Any:
        return self.versions[name]

    def touch(self, name: str) -> None:
        pass

    def model_available(self, name: str) -> bool:
        return name in self.versions

    def loads_first(self, name: str) -> bool:
        return False


def _run(error: MpsdError) -> tuple[MpsdError, SlowPlane]:
    async def body() -> tuple[MpsdError, SlowPlane]:
        slow = SlowPlane()
        models = StepModels(
            {
                "slow": FakeVersion("slow", _model_config("slow", ("x",)), slow),
                "failing": FakeVersion(
                    "failing", _model_config("failing", ("x",)), FailingPlane(slow, error)
                ),
                "join": FakeVersion("join", _model_config("join", ("a", "b")), JoinPlane()),
            }
        )
        plane = EnsemblePlane("branches", 1, ModelConfig.model_validate(ENSEMBLE), models)
        plane.closed = None  # loaded: what the version's lifecycle sets
        x = InputTensor("X", "FP32", (4,), np.ones(4, np.float32).tobytes())
        request = InferRequest("branches", "1", "r", (x,), ("OUT",))
        with pytest.raises(MpsdError) as raised:
            await asyncio.wait_for(plane.infer(request), 10)
        return raised.value, slow

    return asyncio.run(body())


@pytest.mark.parametrize(
    "error",
    [
        InvalidArgument("the step's input is out of range"),
        NotFound("no such thing"),
        ResourceExhausted("the step's queue is full"),
    ],
    ids=lambda e: e.code.value,
)
def test_a_failing_step_s_status_code_reaches_the_client(error: MpsdError) -> None:
    failed, _ = _run(error)
    assert failed.code == error.code != ErrorCode.INTERNAL
    assert failed.message == f"ensemble 'branches' step 1 (model 'failing'): {error.message}"


def test_the_steps_still_running_are_cancelled_when_one_fails() -> None:
    failed, slow = _run(InvalidArgument("bad"))
    assert failed.code == ErrorCode.INVALID_ARGUMENT
    assert slow.cancelled
