"""An ensemble's steps in one process (core/ensemble.py's `EnsemblePlane`) on step models that are fakes
answering with numpy functions: steps run in the graph's order whatever the order they are listed in, each
step's inputs are the tensors its input_map names and its outputs become the tensors its output_map names,
independent steps run at once, a step's input check names the step and the tensor, the caller going away
cancels every step running, and a decoupled last step's responses are the ensemble's, each with the
earlier steps' outputs. A failing step's status and the cancellation of the others are
test_ensemble_failures.py's; ensembles over the wire are test_ensemble.py's."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core.ensemble import EnsemblePlane
from mpsd.daemon.dataplane.request import InferRequest, InferResult, InputTensor, OutputTensor
from mpsd.errors import ErrorCode, MpsdError

F4 = {"data_type": "TYPE_FP32", "dims": [4]}
Arrays = dict[str, np.ndarray]


def step_config(inputs: tuple[str, ...], outputs: tuple[str, ...], decoupled: bool = False) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": n, **F4} for n in inputs],
            "output": [{"name": n, **F4} for n in outputs],
            "model_transaction_policy": {"decoupled": decoupled},
        }
    )


def ensemble(name: str, steps: list[dict[str, Any]], outputs: tuple[str, ...], **extra: Any) -> ModelConfig:
    return ModelConfig.model_validate(
        {
            "name": name,
            "backend": "ensemble",
            "max_batch_size": 0,
            "input": [{"name": "X", **F4}],
            "output": [{"name": n, **F4} for n in outputs],
            "ensemble_scheduling": {"step": steps},
            **extra,
        }
    )


def step(model: str, inputs: dict[str, str], outputs: dict[str, str]) -> dict[str, Any]:
    return {"model_name": model, "input_map": inputs, "output_map": outputs}


@dataclass
class FnPlane:
    """A step model's plane: `fn` of its inputs as arrays, after `gate` (when given) lets it go on; it logs
    each request it starts, and whether it was cancelled."""

    name: str
    fn: Callable[[Arrays], Arrays]
    log: list[str]
    gate: Callable[[], Any] | None = None
    seen: list[InferRequest] = field(default_factory=list)
    cancelled: bool = False

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        self.log.append(self.name)
        self.seen.append(request)
        try:
            if self.gate is not None:
                await self.gate()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        got = {t.name: np.frombuffer(bytes(t.data), np.float32) for t in request.inputs}
        made = self.fn(got)
        return InferResult(
            self.name, 1, tuple(OutputTensor(k, "FP32", (4,), v.tobytes()) for k, v in made.items())
        )

    async def stream(
        self, request: InferRequest, deadline: float | None = None
    ) -> AsyncGenerator[InferResult]:
        self.log.append(self.name)
        x = np.frombuffer(bytes(request.inputs[0].data), np.float32)
        for i in range(3):
            yield InferResult(self.name, 1, (OutputTensor("part", "FP32", (4,), (x + i).tobytes()),))


@dataclass
class Version:
    name: str
    config: ModelConfig
    plane: Any
    version: int = 1


class StepModels:
    """The registry as an ensemble uses it."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.versions: dict[str, Version] = {}
        self.asked: list[tuple[str, str]] = []  # (model, version) of each step's acquire

    def add(
        self,
        name: str,
        inputs: tuple[str, ...],
        outputs: tuple[str, ...],
        fn: Callable[[Arrays], Arrays],
        gate: Callable[[], Any] | None = None,
        decoupled: bool = False,
    ) -> FnPlane:
        plane = FnPlane(name, fn, self.log, gate)
        self.versions[name] = Version(name, step_config(inputs, outputs, decoupled), plane)
        return plane

    async def acquire(self, name: str, version: str, deadline: float | None) -> Any:
        self.asked.append((name, version))
        return self.versions[name]

    def touch(self, name: str) -> None:
        pass

    def loads_first(self, name: str) -> bool:
        return False

    def model_available(self, name: str) -> bool:
        return name in self.versions

    def plane(self, config: ModelConfig) -> EnsemblePlane:
        assert config.name is not None
        plane = EnsemblePlane(config.name, 1, config, self)
        plane.closed = None  # loaded: what the version's lifecycle sets
        return plane


X = np.array([1, 2, 3, 4], np.float32)


def request(name: str, outputs: tuple[str, ...], x: np.ndarray = X) -> InferRequest:
    return InferRequest(name, "1", "r", (InputTensor("X", "FP32", x.shape, x.tobytes()),), outputs)


def arrays(result: InferResult) -> Arrays:
    return {o.name: np.frombuffer(bytes(o.data), np.float32) for o in result.outputs}


def test_steps_run_in_the_graphs_order_and_each_reads_and_makes_the_tensors_its_maps_name() -> None:
    models = StepModels()
    models.add("double", ("x",), ("y",), lambda t: {"y": t["x"] * 2})
    add = models.add(
        "add", ("a", "b"), ("sum", "diff"), lambda t: {"sum": t["a"] + t["b"], "diff": t["a"] - t["b"]}
    )
    config = ensemble(
        "chain",
        [  # listed before the step whose output it reads
            step("add", {"a": "doubled", "b": "X"}, {"sum": "SUM", "diff": "DIFF"}),
            step("double", {"x": "X"}, {"y": "doubled"}),
        ],
        ("SUM", "DIFF"),
    )
    result = asyncio.run(models.plane(config).infer(request("chain", ("SUM",))))
    assert models.log == ["double", "add"]
    [seen] = add.seen
    assert [(t.name, np.frombuffer(bytes(t.data), np.float32).tolist()) for t in seen.inputs] == [
        ("a", [2, 4, 6, 8]),
        ("b", [1, 2, 3, 4]),
    ]
    assert seen.outputs == ("sum", "diff")
    assert result.model == "chain" and list(arrays(result)) == ["SUM"]  # what the request asked for
    np.testing.assert_array_equal(arrays(result)["SUM"], X * 3)


def test_a_steps_model_version_0_or_minus_1_is_the_latest_and_another_is_that_version() -> None:
    """docs/configuration.md: a step's `model_version` -1, or 0 (what a config.pbtxt that leaves it out
    says), asks for the step model's latest version; any other asks for that one."""
    models = StepModels()
    models.add("double", ("x",), ("y",), lambda t: {"y": t["x"] * 2})
    for version, asked in ((0, ""), (-1, ""), (2, "2")):
        steps = [{**step("double", {"x": "X"}, {"y": "Y"}), "model_version": version}]
        asyncio.run(models.plane(ensemble("pinned", steps, ("Y",))).infer(request("pinned", ("Y",))))
        assert models.asked[-1] == ("double", asked), version


def test_independent_steps_run_at_the_same_time() -> None:
    """Each of two steps from X waits until the other has started: run one after the other, neither ends."""

    async def body() -> Arrays:
        started = {"left": asyncio.Event(), "right": asyncio.Event()}

        def gate(mine: str, other: str) -> Callable[[], Any]:
            async def wait() -> None:
                started[mine].set()
                await started[other].wait()

            return wait

        models = StepModels()
        models.add("left", ("x",), ("y",), lambda t: {"y": t["x"] + 1}, gate("left", "right"))
        models.add("right", ("x",), ("y",), lambda t: {"y": t["x"] - 1}, gate("right", "left"))
        config = ensemble(
            "branches",
            [step("left", {"x": "X"}, {"y": "L"}), step("right", {"x": "X"}, {"y": "R"})],
            ("L", "R"),
        )
        result = await asyncio.wait_for(models.plane(config).infer(request("branches", ("L", "R"))), 10)
        return arrays(result)

    got = asyncio.run(body())
    np.testing.assert_array_equal(got["L"], X + 1)
    np.testing.assert_array_equal(got["R"], X - 1)


def test_a_steps_input_that_fails_its_models_check_names_the_step_and_the_tensor() -> None:
    models = StepModels()
    double = models.add("double", ("x",), ("y",), lambda t: {"y": t["x"] * 2})
    config = ModelConfig.model_validate(
        {
            "name": "strict",
            "backend": "ensemble",
            "max_batch_size": 0,
            "input": [{"name": "X", "data_type": "TYPE_FP32", "dims": [-1]}],  # any length; the step's: 4
            "output": [{"name": "Y", "data_type": "TYPE_FP32", "dims": [-1]}],
            "ensemble_scheduling": {"step": [step("double", {"x": "X"}, {"y": "Y"})]},
        }
    )
    with pytest.raises(MpsdError) as raised:
        asyncio.run(models.plane(config).infer(request("strict", ("Y",), np.ones(3, np.float32))))
    assert raised.value.code == ErrorCode.INVALID_ARGUMENT
    assert raised.value.message == (
        "ensemble 'strict' step 0 (model 'double'): input 'x': shape [3] does not match the model's dims [4] "
        "(ensemble tensor 'X')"
    )
    assert double.seen == []


def test_every_running_step_is_cancelled_when_the_caller_goes_away() -> None:
    async def body() -> tuple[FnPlane, FnPlane]:
        both = asyncio.Event()
        count = 0

        async def forever() -> None:
            nonlocal count
            count += 1
            if count == 2:
                both.set()
            await asyncio.get_running_loop().create_future()

        models = StepModels()
        left = models.add("left", ("x",), ("y",), lambda t: t, forever)
        right = models.add("right", ("x",), ("y",), lambda t: t, forever)
        config = ensemble(
            "slow", [step("left", {"x": "X"}, {"y": "L"}), step("right", {"x": "X"}, {"y": "R"})], ("L", "R")
        )
        task = asyncio.ensure_future(models.plane(config).infer(request("slow", ("L", "R"))))
        await asyncio.wait_for(both.wait(), 10)
        task.cancel()
        await asyncio.wait({task}, timeout=10)  # a step left running would hold the request
        assert task.cancelled()
        return left, right

    left, right = asyncio.run(body())
    assert left.cancelled and right.cancelled


def _streamed(models: StepModels, decoupled: bool) -> ModelConfig:
    models.add("double", ("x",), ("y",), lambda t: {"y": t["x"] * 2})
    models.add("count", ("x",), ("part",), lambda t: t, decoupled=True)
    return ensemble(
        "streamed",
        [step("double", {"x": "X"}, {"y": "DOUBLED"}), step("count", {"x": "DOUBLED"}, {"part": "PART"})],
        ("DOUBLED", "PART"),
        model_transaction_policy={"decoupled": decoupled},
    )


def test_a_decoupled_last_steps_responses_each_carry_the_earlier_steps_outputs() -> None:
    models = StepModels()
    plane = models.plane(_streamed(models, decoupled=True))

    async def body() -> list[Arrays]:
        return [arrays(r) async for r in plane.stream(request("streamed", ("DOUBLED", "PART")))]

    responses = asyncio.run(body())
    assert len(responses) == 3 and models.log == ["double", "count"]
    for i, got in enumerate(responses):
        np.testing.assert_array_equal(got["PART"], X * 2 + i)
        np.testing.assert_array_equal(got["DOUBLED"], X * 2)


def test_an_ensemble_that_is_not_decoupled_refuses_a_decoupled_step() -> None:
    models = StepModels()
    plane = models.plane(_streamed(models, decoupled=False))
    with pytest.raises(MpsdError) as raised:
        asyncio.run(plane.infer(request("streamed", ("DOUBLED", "PART"))))
    assert raised.value.code == ErrorCode.INVALID_ARGUMENT
    assert raised.value.message.startswith(
        "ensemble 'streamed' step 1 (model 'count') runs a decoupled model"
    )
