"""An ensemble's data plane: a request runs through the steps' models as the ensemble's graph says, each
step as soon as the tensors it reads exist (independent steps at once), each through its model's own data
plane, so the ensemble's requests batch with the model's other traffic and load it on demand.

Tensors between steps stay in the daemon: a step's outputs, as its worker wrote them, are the next steps'
inputs. A failed step fails the request with the step named and its own status; the steps still running
are cancelled, and so is every step when the caller goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from mpsd.config.ensemble import EnsembleStep, step_label
from mpsd.config.model_config import ModelConfig
from mpsd.daemon.core import requests
from mpsd.daemon.core.inputs import check_input
from mpsd.daemon.core.model_version import ModelVersion
from mpsd.daemon.core.requests import Stages
from mpsd.daemon.dataplane.plane import VersionPlane
from mpsd.daemon.dataplane.request import Deferred, InferRequest, InferResult, InputTensor, OutputTensor
from mpsd.daemon.dataplane.tracing import RequestTrace, stage_of
from mpsd.errors import InvalidArgument, MpsdError, Unavailable


class StepModels(Protocol):
    """What an ensemble needs of the registry: its steps' models, loaded on demand."""

    async def acquire(self, name: str, version: str, deadline: float | None) -> ModelVersion: ...

    def touch(self, name: str) -> None: ...

    def model_available(self, name: str) -> bool: ...

    def loads_first(self, name: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class Tensor:
    """An ensemble tensor: an input of the request or an output of a step."""

    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | Deferred


Responses = AsyncGenerator[InferResult, None]


class EnsemblePlane(VersionPlane):
    """The plane of an ensemble's version: no lanes of its own, its steps' models' planes instead."""

    def __init__(
        self, name: str, version: int, config: ModelConfig, models: StepModels, stages: Stages | None = None
    ) -> None:
        super().__init__(name, version, config)
        assert config.ensemble_scheduling is not None
        self.steps = config.ensemble_scheduling.step
        self.models = models
        self.stages = stages if stages is not None else Stages()  # a step's cache, as a client request's
        self.decoupled = config.model_transaction_policy.decoupled

    @property
    def ready(self) -> bool:
        """Open, and every step's model is ready or loads on its first request."""
        return self.closed is None and all(self.models.model_available(s.model_name) for s in self.steps)

    def lanes_down(self) -> str:
        """An ensemble has no lanes: what keeps it from serving is its steps' models that are not available
        (the repository index, `mpsd models` and a refused request all give this reason)."""
        missing = [s.model_name for s in self.steps if not self.models.model_available(s.model_name)]
        if not missing:
            return ""
        return "step model(s) " + ", ".join(f"'{m}'" for m in dict.fromkeys(missing)) + " not available"

    def refusal(self) -> Unavailable:
        if self.closed is not None:
            return super().refusal()
        return Unavailable(f"ensemble '{self.name}' version {self.version} is not ready: {self.lanes_down()}")

    def _where(self, index: int) -> str:
        return f"ensemble '{self.name}' {step_label(index, self.steps[index])}"

    async def infer(self, request: InferRequest, deadline: float | None = None) -> InferResult:
        if not self.ready:
            raise self.refusal()
        start = time.perf_counter_ns()
        try:
            with self.flight:
                tensors, streamed = await self._run(request, deadline)
                if streamed is not None:
                    await streamed.aclose()
                    raise InvalidArgument(
                        f"{self._where(streamed.index)} runs a decoupled model: the ensemble must be "
                        "decoupled too (model_transaction_policy.decoupled)"
                    )
        except MpsdError as exc:
            self.stats.record_failure(time.perf_counter_ns() - start, exc.code.value)
            raise
        self.stats.record_success(time.perf_counter_ns() - start, request.batch_size)
        return InferResult(self.name, self.version, self._outputs(request, tensors))

    async def stream(self, request: InferRequest, deadline: float | None = None) -> Responses:
        """A decoupled ensemble: its steps run as for `infer`, and the responses of its decoupled step (at
        most one, whose outputs no other step reads) are its responses, each with the ensemble's outputs
        made so far; without a decoupled step it answers once."""
        if not self.ready:
            raise self.refusal()
        start = time.perf_counter_ns()
        delivered = 0
        try:
            with self.flight:
                tensors, streamed = await self._run(request, deadline)
                if streamed is None:
                    delivered = 1
                    yield InferResult(self.name, self.version, self._outputs(request, tensors))
                else:
                    try:
                        async for part in streamed:
                            made = dict(tensors)
                            for out in part.outputs:
                                made[out.name] = Tensor(out.datatype, out.shape, out.data)
                            delivered += 1
                            yield InferResult(
                                self.name, self.version, self._outputs(request, made, partial=True)
                            )
                    finally:
                        await streamed.aclose()
        except MpsdError as exc:
            self.stats.record_failure(time.perf_counter_ns() - start, exc.code.value)
            raise
        self.stats.record_success(time.perf_counter_ns() - start, request.batch_size, delivered)

    def _outputs(
        self, request: InferRequest, tensors: Mapping[str, Tensor], partial: bool = False
    ) -> tuple[OutputTensor, ...]:
        outputs = []
        for name in request.outputs:
            t = tensors.get(name)
            if t is None:
                if partial:
                    continue
                raise Unavailable(f"ensemble '{self.name}': no step made output '{name}'")
            data = t.data
            if isinstance(data, memoryview):
                data = bytes(data)
            elif not isinstance(data, bytes):  # a client's shared memory: the graph never passes it on
                raise Unavailable(f"ensemble '{self.name}': output '{name}' is an input of the request")
            outputs.append(OutputTensor(name, t.datatype, t.shape, data))
        return tuple(outputs)

    async def _run(
        self, request: InferRequest, deadline: float | None
    ) -> tuple[dict[str, Tensor], StreamedStep | None]:
        """Run every step, each once the tensors it reads exist; the tensors made, and the responses of a
        decoupled step (not read yet) when there is one."""
        tensors: dict[str, Tensor] = {t.name: Tensor(t.datatype, t.shape, t.data) for t in request.inputs}
        waiting = set(range(len(self.steps)))
        running: dict[asyncio.Task[Sequence[OutputTensor] | StreamedStep], int] = {}
        streamed: StreamedStep | None = None
        try:
            while waiting or running:
                for i in sorted(waiting):
                    if set(self.steps[i].input_map.values()) <= tensors.keys():
                        waiting.discard(i)
                        running[asyncio.ensure_future(self._step(i, request, tensors, deadline))] = i
                if not running:  # the graph is checked at load: only a step that made nothing gets here
                    raise Unavailable(f"ensemble '{self.name}': steps wait for tensors no step made")
                done, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = running.pop(task)
                    made = task.result()
                    if isinstance(made, StreamedStep):
                        streamed = made
                        continue
                    for out in made:
                        tensors[self.steps[i].output_map[out.name]] = Tensor(
                            out.datatype, out.shape, out.data
                        )
        except BaseException:
            if streamed is not None:
                await streamed.aclose()
            raise
        finally:
            for task in running:
                task.cancel()
            if running:
                await asyncio.gather(*running, return_exceptions=True)
        return tensors, streamed

    async def _step(
        self, index: int, request: InferRequest, tensors: Mapping[str, Tensor], deadline: float | None
    ) -> Sequence[OutputTensor] | StreamedStep:
        """Run one step as its model's request; a traced ensemble request's step is a span, the parent of
        that request's spans. A decoupled step's responses are the caller's to read."""
        step = self.steps[index]
        version = str(step.model_version) if step.model_version > 0 else ""
        trace = stage_of(request.trace).nested("step", step=index, model_name=step.model_name)
        limits = requests.Deadline.of(deadline, request.timeout_us)  # the step's own, as a request's
        try:
            mv = await self.stages.acquire(self.models, step.model_name, version, limits.bounded, trace)
            step_request = self._request(index, step, mv, request, tensors, trace.carried)
            deadline = limits.queue(step_request, mv.config)
            if mv.config.model_transaction_policy.decoupled:
                if any(t in s.input_map.values() for s in self.steps for t in step.output_map.values()):
                    raise InvalidArgument(
                        "its model is decoupled, and another step reads its outputs: only the last step "
                        "of an ensemble may be decoupled"
                    )
                trace.end()  # the step's span covers its start; its responses are the stream's
                return StreamedStep(index, step, mv.plane.stream(step_request, deadline), self)
            result = await self.stages.infer(mv, step_request, deadline)
        except MpsdError as exc:
            trace.end(exc)
            raise MpsdError(f"{self._where(index)}: {exc.message}", exc.code) from None
        finally:
            self.models.touch(step.model_name)
        trace.end()
        return result.outputs

    def _request(
        self,
        index: int,
        step: EnsembleStep,
        mv: ModelVersion,
        request: InferRequest,
        tensors: Mapping[str, Tensor],
        trace: RequestTrace | None,
    ) -> InferRequest:
        """The step's request: its model's inputs from the ensemble's tensors, checked against that model's
        config as a client's would be (datatype, dims, batch size)."""
        config = mv.config
        configured = config.input_by_name
        unknown = sorted(set(step.input_map) - set(configured))
        if unknown:
            raise InvalidArgument(f"input_map names input(s) {', '.join(unknown)} the model does not have")
        outputs = config.output_by_name
        missing = sorted(set(step.output_map) - set(outputs))
        if missing:
            raise InvalidArgument(f"output_map names output(s) {', '.join(missing)} the model does not have")
        batched = config.max_batch_size > 0
        inputs = []
        for name, cfg in configured.items():
            source = step.input_map.get(name)
            if source is None:
                raise InvalidArgument(f"the model's input '{name}' is not in the step's input_map")
            t = tensors[source]
            try:  # a client's checks, in its words
                check_input(mv.name, cfg, t.datatype, t.shape, config.max_batch_size)
            except MpsdError as exc:
                raise MpsdError(f"{exc.message} (ensemble tensor '{source}')", exc.code) from None
            inputs.append(InputTensor(name, t.datatype, t.shape, t.data))
        batch = inputs[0].shape[0] if batched and inputs and inputs[0].shape else 1
        chain = request.chain | {(self.name, self.version)}  # a step's model may not call the ensemble
        return requests.for_step(
            config, step.model_name, mv.version, request, tuple(inputs), tuple(step.output_map), batch, chain,
            trace,
        )  # fmt: skip


class StreamedStep:
    """A decoupled step's responses, their outputs named as the ensemble's tensors."""

    def __init__(self, index: int, step: EnsembleStep, responses: Responses, plane: EnsemblePlane) -> None:
        self.index = index
        self.step = step
        self.responses = responses
        self.plane = plane

    def __aiter__(self) -> Responses:
        return self._mapped()

    async def _mapped(self) -> Responses:
        try:
            async for result in self.responses:
                outputs = tuple(
                    OutputTensor(self.step.output_map[o.name], o.datatype, o.shape, o.data)
                    for o in result.outputs
                )
                yield InferResult(result.model, result.version, outputs, result.timings)
        except MpsdError as exc:
            raise MpsdError(f"{self.plane._where(self.index)}: {exc.message}", exc.code) from None

    async def aclose(self) -> None:
        await self.responses.aclose()
