"""KServe v2 / Triton `GRPCInferenceService`: thin methods that translate protocol <-> domain."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import grpc
import structlog
from google.protobuf.message import DecodeError

from mpsd.daemon.api import describe
from mpsd.daemon.api.call import (
    NO_PARAMS,
    TYPED_CONTENTS,
    InferCall,
    InputCall,
    OutputCall,
    Param,
    Params,
    RawEntry,
)
from mpsd.daemon.api.grpc.known_headers import Binder, KnownHeader, KnownHeaders, known_id
from mpsd.daemon.api.grpc.load import load_parameters
from mpsd.daemon.api.grpc.responses import ResponseTemplates, infer_response_parts
from mpsd.daemon.api.grpc.stream import RequestStream
from mpsd.daemon.api.grpc.trace import came_with, sampled, trace_setting
from mpsd.daemon.api.operations import Operations
from mpsd.daemon.api.tracing import Incoming
from mpsd.errors import InvalidArgument, MpsdError
from mpsd.ipc.infer_wire import SplitRequest, split_request
from mpsd.net.status import grpc_status
from mpsd.proto import grpc_service_pb2 as pb
from mpsd.proto import grpc_service_pb2_grpc as pb_grpc

log = structlog.get_logger("mpsd.daemon.grpc")
T = TypeVar("T")
Handler = Callable[..., Awaitable[T]]

STREAM_WINDOW = 256


def status_mapped(method: Handler[T]) -> Handler[T]:
    """Map mpsd errors to their gRPC status in one place; unexpected errors become INTERNAL."""

    @functools.wraps(method)
    async def wrapper(self: Any, request: Any, context: grpc.aio.ServicerContext) -> T:
        try:
            return await method(self, request, context)
        except MpsdError as exc:
            await context.abort(grpc_status(exc), exc.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:
            log.exception("unexpected error", rpc=method.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        raise AssertionError("unreachable")

    return wrapper


class InferenceServicer(pb_grpc.GRPCInferenceServiceServicer):  # type: ignore[misc]
    """The gRPC adapter over `Operations`: protobuf in, protobuf out."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops
        self.registry = ops.registry
        self.client_shm = self.ops.client_shm
        self.responses = ResponseTemplates()
        self.known = KnownHeaders()  # ModelInfer headers that passed their checks

    # ---- health and metadata ---------------------------------------------------------------------

    @status_mapped
    async def ServerLive(self, request: Any, context: Any) -> Any:
        return pb.ServerLiveResponse(live=self.ops.live())

    @status_mapped
    async def ServerReady(self, request: Any, context: Any) -> Any:
        return pb.ServerReadyResponse(ready=self.ops.ready())

    @status_mapped
    async def ModelReady(self, request: Any, context: Any) -> Any:
        return pb.ModelReadyResponse(ready=self.ops.model_ready(request.name, request.version))

    @status_mapped
    async def ServerMetadata(self, request: Any, context: Any) -> Any:
        return pb.ServerMetadataResponse(**self.ops.server_metadata())

    @status_mapped
    async def ModelMetadata(self, request: Any, context: Any) -> Any:
        config, versions = self.ops.metadata(request.name, request.version)
        return describe.model_metadata(request.name, versions, config)

    @status_mapped
    async def ModelConfig(self, request: Any, context: Any) -> Any:
        mv = self.registry.route(request.name, request.version)
        return pb.ModelConfigResponse(config=describe.effective_config(request.name, mv))

    @status_mapped
    async def ModelStatistics(self, request: Any, context: Any) -> Any:
        return describe.statistics(self.ops.statistics(request.name, request.version))

    # ---- inference -----------------------------------------------------------------------------------

    async def _infer(self, request: Any, came: Incoming | None = None) -> Any:
        """A parsed ModelInferRequest's response, raw_output_contents included."""
        answered = await self.ops.infer(infer_call(request), came=came)
        with answered.trace.answering():
            response, raw = infer_response_parts(answered.result, request.id, in_shm=answered.in_shm)
        response.raw_output_contents.extend(raw)
        return response

    async def infer_serialized(
        self, data: bytes | bytearray, deadline: float | None, came: Incoming | None = None
    ) -> bytes:
        """ModelInfer on serialized bytes: request bytes in, response bytes out, MpsdError on failure."""
        return b"".join(await self.infer_serialized_parts(data, deadline, came))

    async def infer_serialized_parts(
        self,
        data: bytes | bytearray | memoryview | SplitRequest,
        deadline: float | None,
        came: Incoming | None = None,
    ) -> list[bytes | memoryview]:
        """ModelInfer for a front process: the response as consecutive pieces (`raw_output_parts`), which
        its link writes with one scatter-gather send, copying no tensor bytes. `data` may be a view of the
        front's arena: the tensor bytes are then read in place; or the request as its front split it. A
        traced call takes the full path."""
        split = data if isinstance(data, SplitRequest) else split_request(data)
        raw = split.raw if split is not None else None
        # Only a request with raw contents has a header to learn; its key leaves the id out.
        key = split.key if split is not None and raw else None
        if split is not None and key is not None:
            if came is not None:
                came = sampled(self.ops, self.known, split.key, came)
            parts = await self._infer_known(split, deadline) if came is None else None
            if parts is not None:
                return parts
        header = split.rest if split is not None else data
        assert not isinstance(header, SplitRequest)
        if isinstance(header, memoryview):  # no raw contents to cut out: parse a copy, as protobuf wants
            header = bytes(header)
        try:
            request = pb.ModelInferRequest.FromString(header)
        except DecodeError as exc:
            raise InvalidArgument(f"the request is not a valid protobuf message: {exc}") from None
        call = infer_call(request, raw or None)
        learn = self.known.learner(key, call) if key is not None else None
        answered = await self.ops.infer(call, deadline, learn, came)
        with answered.trace.answering():
            return self.responses.parts(answered.result, request.id, answered.in_shm)

    async def _infer_known(
        self, split: SplitRequest, deadline: float | None
    ) -> list[bytes | memoryview] | None:
        """The answer to a request whose header is known, without parsing it; None: the full path takes it."""
        found = self.known_call(split)
        if found is None:
            return None
        known, request_id, bind = found
        answered = await self.ops.infer_checked(known.model, known.version, bind, deadline)
        if answered is None:
            return None
        return self.responses.parts(answered.result, request_id)

    def known_call(self, split: SplitRequest) -> tuple[KnownHeader, str, Binder] | None:
        """A request whose header is known: that header, the request's id and what binds its bytes to it
        (None: the header is not known, or the id needs the full path's judgement)."""
        known = self.known.get(split.key)
        request_id = known_id(split.request_id) if known is not None else None
        if known is None or request_id is None:
            return None
        return known, request_id, self.known.binder(known, split.key, split.raw, request_id)

    @status_mapped
    async def ModelInfer(self, request: bytes, context: Any) -> bytes:
        """Registered without protobuf (de)serializers (`add_to_server`): the same bytes path as a front's."""
        remaining = context.time_remaining()
        deadline = time.monotonic() + remaining if remaining is not None else None
        came = came_with(context, "ModelInfer") if self.ops.tracing.on else None
        return await self.infer_serialized(request, deadline, came)

    async def ModelStreamInfer(
        self, request_iterator: AsyncIterator[Any], context: Any
    ) -> AsyncIterator[Any]:
        """Requests of one stream run concurrently, errors in-band. Responses of ordinary models come back in
        request order; a decoupled model's responses come back as the model yields them, interleaved with
        the rest, each marked with Triton's `triton_final_response` parameter (false), and with an empty
        final response (true) when the request set `triton_enable_empty_final_response`.

        At most STREAM_WINDOW requests of a stream are in progress and at most STREAM_WINDOW responses wait
        to be written: past that the stream stops reading, a decoupled model is held at its next response,
        and HTTP/2 flow control holds the client back, so one stream cannot fill the daemon's memory.
        """

        def came() -> Incoming | None:
            return came_with(context, "ModelStreamInfer") if self.ops.tracing.on else None

        async def answer(request: Any) -> Any:
            try:
                return pb.ModelStreamInferResponse(infer_response=await self._infer(request, came()))
            except MpsdError as exc:
                return self._stream_error(request, exc.message)
            except Exception as exc:
                log.exception("unexpected error in stream")
                return self._stream_error(request, f"{type(exc).__name__}: {exc}")

        stream = RequestStream(
            answer,
            lambda request: self._stream_responses(request, came()),
            lambda request: self.ops.decoupled(request.model_name, request.model_version),
            STREAM_WINDOW,
        )
        async with aclosing(stream.responses(request_iterator)) as responses:
            async for response in responses:
                yield response

    async def _stream_responses(self, request: Any, came: Incoming | None) -> AsyncIterator[Any]:
        """One request to a decoupled model, as the stream's responses: each of its responses, then the
        empty final one if asked for; an error in-band."""
        params = request.parameters
        wants_final = "triton_enable_empty_final_response" in params and (
            params["triton_enable_empty_final_response"].bool_param
        )
        version = request.model_version
        try:
            responses = self.ops.stream(infer_call(request), came=came)
            try:
                async for answered in responses:
                    response, raw = infer_response_parts(answered.result, request.id, answered.in_shm)
                    response.raw_output_contents.extend(raw)
                    response.parameters["triton_final_response"].bool_param = False
                    version = response.model_version
                    yield pb.ModelStreamInferResponse(infer_response=response)
            finally:
                await responses.aclose()
        except MpsdError as exc:
            yield self._stream_error(request, exc.message)
            return
        except Exception as exc:
            log.exception("unexpected error in stream")
            yield self._stream_error(request, f"{type(exc).__name__}: {exc}")
            return
        if wants_final:
            final = pb.ModelInferResponse(model_name=request.model_name, model_version=version, id=request.id)
            final.parameters["triton_final_response"].bool_param = True
            yield pb.ModelStreamInferResponse(infer_response=final)

    @staticmethod
    def _stream_error(request: Any, message: str) -> Any:
        return pb.ModelStreamInferResponse(
            error_message=message,
            infer_response=pb.ModelInferResponse(
                model_name=request.model_name, model_version=request.model_version, id=request.id
            ),
        )

    # ---- repository ----------------------------------------------------------------------------------

    @status_mapped
    async def RepositoryIndex(self, request: Any, context: Any) -> Any:
        rows = self.ops.index(request.repository_name, request.ready)
        return pb.RepositoryIndexResponse(
            models=[
                pb.RepositoryIndexResponse.ModelIndex(
                    name=r.name, version=r.version, state=r.state, reason=r.reason
                )
                for r in rows
            ]
        )

    @status_mapped
    async def RepositoryModelLoad(self, request: Any, context: Any) -> Any:
        params = load_parameters(request.parameters)
        await self.ops.load(request.repository_name, request.model_name, params)
        return pb.RepositoryModelLoadResponse()

    @status_mapped
    async def RepositoryModelUnload(self, request: Any, context: Any) -> Any:
        await self.ops.unload(request.repository_name, request.model_name)
        return pb.RepositoryModelUnloadResponse()

    # ---- system shared memory ------------------------------------------------------------------------

    @status_mapped
    async def SystemSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        reply = pb.SystemSharedMemoryStatusResponse()
        for region in self.ops.shm_status(request.name):
            reply.regions[region.name].CopyFrom(
                pb.SystemSharedMemoryStatusResponse.RegionStatus(
                    name=region.name, key=region.key, offset=region.offset, byte_size=region.byte_size
                )
            )
        return reply

    @status_mapped
    async def SystemSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        self.ops.shm_register(request.name, request.key, request.offset, request.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    @status_mapped
    async def SystemSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.ops.shm_unregister(request.name)
        return pb.SystemSharedMemoryUnregisterResponse()

    # ---- CUDA shared memory --------------------------------------------------------------------------

    @status_mapped
    async def CudaSharedMemoryStatus(self, request: Any, context: Any) -> Any:
        reply = pb.CudaSharedMemoryStatusResponse()
        for region in self.ops.cuda_shm_status(request.name):
            reply.regions[region.name].CopyFrom(
                pb.CudaSharedMemoryStatusResponse.RegionStatus(
                    name=region.name, device_id=region.device_id, byte_size=region.byte_size
                )
            )
        return reply

    @status_mapped
    async def CudaSharedMemoryRegister(self, request: Any, context: Any) -> Any:
        await self.ops.cuda_shm_register(
            request.name, request.raw_handle, request.device_id, request.byte_size
        )
        return pb.CudaSharedMemoryRegisterResponse()

    @status_mapped
    async def CudaSharedMemoryUnregister(self, request: Any, context: Any) -> Any:
        self.ops.cuda_shm_unregister(request.name)
        return pb.CudaSharedMemoryUnregisterResponse()

    # ---- settings ------------------------------------------------------------------------------------

    @status_mapped
    async def TraceSetting(self, request: Any, context: Any) -> Any:
        return trace_setting(self.ops, request)

    @status_mapped
    async def LogSettings(self, request: Any, context: Any) -> Any:
        """Triton's runtime log settings, mapped onto mpsd's one output level; an empty request reads."""
        updates: dict[str, bool | int | str] = {}
        for key, value in request.settings.items():
            choice = value.WhichOneof("parameter_choice")
            if choice is None:
                raise InvalidArgument(f"log setting '{key}' has no value")
            updates[key] = getattr(value, choice)
        current = self.ops.log_settings(updates)
        reply = pb.LogSettingsResponse()
        for key, setting in current.items():
            field = {bool: "bool_param", int: "uint32_param", str: "string_param"}[type(setting)]
            setattr(reply.settings[key], field, setting)
        return reply


def params(parameters: Mapping[str, Any]) -> Params:
    """InferParameters by key, each as its kind and value ("" and "" for one with no value set)."""
    if not parameters:
        return NO_PARAMS
    found = {}
    for key, value in parameters.items():
        choice = value.WhichOneof("parameter_choice")
        found[key] = Param(choice.removesuffix("_param"), getattr(value, choice)) if choice else Param("", "")
    return found


def _contents(tensor: Any) -> dict[str, Sequence[Any]]:
    if not tensor.HasField("contents"):
        return {}
    contents = tensor.contents
    return {f: values for f in TYPED_CONTENTS if len(values := getattr(contents, f))}


def infer_call(request: Any, raw: Sequence[RawEntry] | None = None) -> InferCall:
    """The call a ModelInferRequest makes; `raw`, when given, stands for its raw_input_contents."""
    return InferCall(
        request.model_name,
        request.model_version,
        request.id,
        params(request.parameters),
        tuple(
            InputCall(t.name, t.datatype, tuple(t.shape), params(t.parameters), _contents(t))
            for t in request.inputs
        ),
        tuple(OutputCall(o.name, params(o.parameters)) for o in request.outputs),
        tuple(request.raw_input_contents) if raw is None else raw,
    )
