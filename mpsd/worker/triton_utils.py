"""`triton_python_backend_utils` for Triton python-backend models: Triton's module as a model sees it, so
that a Triton `model.py` (`class TritonPythonModel` with `initialize`, `execute`, `finalize`) runs in an
mpsd worker unchanged.

The worker registers this module under Triton's name before it imports the model. Every public name of
Triton's module is here with Triton's behaviour, or refused (mpsd.worker.triton_refused: a model using
one fails to load, naming it and why); docs/triton-python-models.md has the table.
"""

from __future__ import annotations

import enum
import json
import queue
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack

from mpsd.errors import ErrorCode
from mpsd.worker import calls
from mpsd.worker.triton_config import ModelConfig  # noqa: F401 (Triton's module has it)
from mpsd.worker.triton_refused import REFUSED_ARGUMENTS, REFUSED_METHODS, REFUSED_NAMES, refused_name
from mpsd.worker.triton_types import (  # noqa: F401 (Triton's module has them)
    TRITON_STRING_TO_NUMPY,
    deserialize_bytes_tensor,
    numpy_to_triton_type,
    serialize_byte_tensor,
    triton_string_to_numpy,
    triton_to_numpy_type,
)

TRITONSERVER_REQUEST_FLAG_SEQUENCE_START = 1
TRITONSERVER_REQUEST_FLAG_SEQUENCE_END = 2
TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
TRITONSERVER_REQUEST_RELEASE_ALL = 1
TRITONSERVER_REQUEST_RELEASE_RESCHEDULE = 2
TRITONSERVER_MEMORY_GPU = 0  # Triton's PreferredMemory types
TRITONSERVER_MEMORY_CPU = 1


class TritonError(Exception):
    """An error a model reports in a response (`InferenceResponse(error=...)`); raised, mpsd fails the
    request with it as it does a TritonModelException."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


class TritonModelException(Exception):
    """What a model raises to fail its request with a message (the request fails with that message)."""


class Tensor:
    """A named tensor: numpy on the host (`as_numpy`), or a torch tensor through DLPack."""

    def __init__(self, name: str, value: Any) -> None:
        self._name = name
        self._value = value

    def name(self) -> str:
        return self._name

    def as_numpy(self) -> np.ndarray[Any, Any]:
        value = self._value
        if isinstance(value, torch.Tensor):
            return value.detach().cpu().numpy()  # type: ignore[no-any-return]
        return np.asarray(value)

    def triton_dtype(self) -> int | None:
        """The TRITONSERVER_DataType code (11 for FP32, 13 for BYTES)."""
        value = self._value
        if isinstance(value, torch.Tensor):
            return numpy_to_triton_type(torch.empty(0, dtype=value.dtype).numpy().dtype)
        return numpy_to_triton_type(np.asarray(value).dtype)

    def to_dlpack(self) -> Any:
        return torch.as_tensor(self._value).__dlpack__()

    def __dlpack__(self, stream: Any = None) -> Any:
        return torch.as_tensor(self._value).__dlpack__(stream=stream)

    def __dlpack_device__(self) -> tuple[int, int]:
        return torch.as_tensor(self._value).__dlpack_device__()  # type: ignore[no-any-return]

    @staticmethod
    def from_dlpack(name: str, capsule: Any) -> Tensor:
        return Tensor(name, torch.utils.dlpack.from_dlpack(capsule))

    def is_cpu(self) -> bool:
        return not (isinstance(self._value, torch.Tensor) and self._value.device.type != "cpu")

    def shape(self) -> list[int]:
        return list(np.shape(self._value))

    @property
    def value(self) -> Any:
        """What mpsd hands on: the torch tensor or numpy array as given."""
        return self._value


class PreferredMemory:
    """Where a model would like a call's outputs; a preference, as in Triton: a call's outputs arrive on the
    calling model's device."""

    def __init__(self, preferred_memory_type: int, preferred_device_id: int = 0) -> None:
        self.preferred_memory_type = preferred_memory_type
        self.preferred_device_id = preferred_device_id


class InferenceTrace:
    """A request's trace as a model sees it: no context to hand on (what Triton answers without one)."""

    def get_context(self) -> str | None:
        return None


def _refuse_argument(cls: str, name: str, value: Any) -> None:
    if value:
        raise TritonModelException(
            f"{cls}({name}=...) is not supported by mpsd: {REFUSED_ARGUMENTS[cls, name]}"
        )


class InferenceRequest:
    """One request as `execute` sees it (its input tensors: a whole batch of the daemon's), or one a model
    makes to call another model (`model_name`, then `exec()`, through mpsd.worker.calls)."""

    def __init__(
        self,
        request_id: str = "",
        correlation_id: int | str = 0,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        model_name: str = "",
        model_version: int = -1,
        flags: int = 0,
        timeout: int = 0,
        preferred_memory: PreferredMemory | None = None,
        trace: InferenceTrace | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> None:
        if model_name:  # a call to another model: Triton's arguments
            _refuse_argument("InferenceRequest", "parameters", parameters)
        self._id = request_id
        self._correlation_id = correlation_id
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)
        self._model = model_name
        self._version = str(model_version) if model_version > 0 else ""
        self._flags = flags
        self._timeout = timeout  # microseconds, as Triton's
        self._trace = trace or InferenceTrace()
        self._parameters = dict(parameters or {})
        self._sender: InferenceResponseSender | None = None

    @classmethod
    def received(
        cls, inputs: Sequence[Tensor], outputs: Sequence[str], parameters: Mapping[str, Any], decoupled: bool
    ) -> InferenceRequest:
        """The request `execute` gets for one execution (a decoupled model's with its response sender)."""
        request = cls(inputs=inputs, requested_output_names=outputs)
        request._parameters = dict(parameters)
        request._sender = InferenceResponseSender() if decoupled else None
        return request

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def request_id(self) -> str:
        return self._id

    def correlation_id(self) -> int | str:
        return self._correlation_id

    def flags(self) -> int:
        return self._flags

    def set_flags(self, flags: int) -> None:
        self._flags = flags

    def timeout(self) -> int:
        return self._timeout

    def trace(self) -> InferenceTrace:
        return self._trace

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonModelException(
                "get_response_sender is for decoupled models (model_transaction_policy)"
            )
        return self._sender

    def is_cancelled(self) -> bool:
        return False

    def set_release_flags(self, flags: int) -> None:
        raise TritonModelException(
            f"set_release_flags is not supported by mpsd: {REFUSED_METHODS['set_release_flags']}"
        )

    def _call(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        inputs = {t.name(): t.value for t in self._inputs}
        options = {
            "version": self._version,
            "outputs": self._outputs,
            "timeout_s": self._timeout / 1e6 if self._timeout > 0 else None,
            "request_id": self._id,
        }
        return self._model, inputs, options

    def exec(self, decoupled: bool = False) -> Any:
        """Call `model_name` (Triton's BLS): its response, carrying the error if the call failed; with
        `decoupled`, an iterator of its responses."""
        model, inputs, options = self._call()
        if decoupled:
            return ResponseIterator(calls.current().stream(model, inputs, **options))
        try:
            return _response(calls.current().infer(model, inputs, **options))
        except calls.CallError as exc:
            return InferenceResponse(error=_error(exc))

    async def async_exec(self, decoupled: bool = False) -> Any:
        model, inputs, options = self._call()
        if decoupled:
            return ResponseIterator(calls.current().stream(model, inputs, **options))
        try:
            return _response(await calls.current().infer_async(model, inputs, **options))
        except calls.CallError as exc:
            return InferenceResponse(error=_error(exc))


# mpsd's error codes as Triton's (TritonError's codes).
CODES = {
    ErrorCode.NOT_FOUND: TritonError.NOT_FOUND,
    ErrorCode.INVALID_ARGUMENT: TritonError.INVALID_ARG,
    ErrorCode.UNAVAILABLE: TritonError.UNAVAILABLE,
    ErrorCode.UNIMPLEMENTED: TritonError.UNSUPPORTED,
    ErrorCode.ALREADY_EXISTS: TritonError.ALREADY_EXISTS,
    ErrorCode.CANCELLED: TritonError.CANCELLED,
}


def _error(exc: calls.CallError) -> TritonError:
    return TritonError(exc.message, CODES.get(exc.code, TritonError.INTERNAL))


def _response(outputs: Mapping[str, Any]) -> InferenceResponse:
    return InferenceResponse([Tensor(name, value) for name, value in outputs.items()])


class ResponseIterator:
    """A decoupled call's responses (`exec(decoupled=True)`); a failure ends them with a response carrying
    the error; `cancel()` stops the called model at its next response."""

    def __init__(self, stream: calls.Responses) -> None:
        self._stream = stream
        self._ended = False

    def __iter__(self) -> Iterator[InferenceResponse]:
        return self

    def __next__(self) -> InferenceResponse:
        if self._ended:
            raise StopIteration
        try:
            return _response(next(self._stream))
        except StopIteration:
            self._ended = True
            raise
        except calls.CallError as exc:
            self._ended = True
            self._stream.close()
            return InferenceResponse(error=_error(exc))

    def cancel(self) -> None:
        self._stream.close()


class InferenceResponse:
    def __init__(
        self,
        output_tensors: Sequence[Tensor] = (),
        error: TritonError | None = None,
        parameters: Mapping[str, Any] | None = None,
    ) -> None:
        _refuse_argument("InferenceResponse", "parameters", parameters)
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error

    def parameters(self) -> str:
        return "{}"


class InferenceResponseSender:
    """A decoupled model's sender: responses go into a queue the worker streams from, until a final flag."""

    def __init__(self) -> None:
        self.sent: queue.Queue[tuple[InferenceResponse | None, int]] = queue.Queue()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self.sent.put((response, flags))

    def is_cancelled(self) -> bool:
        return False


class Logger:
    """Lines for the daemon's log: the worker's stdout (INFO, VERBOSE) and stderr (WARNING, ERROR) are
    logged by the daemon, tagged with the model, at info and warning."""

    class LogLevel(enum.IntEnum):
        INFO = 0
        WARNING = 1
        ERROR = 2
        VERBOSE = 3

    INFO, WARNING, ERROR, VERBOSE = LogLevel.INFO, LogLevel.WARNING, LogLevel.ERROR, LogLevel.VERBOSE

    @staticmethod
    def log(message: str, level: LogLevel = LogLevel.INFO) -> None:
        stream = sys.stderr if level in (Logger.WARNING, Logger.ERROR) else sys.stdout
        print(f"{Logger.LogLevel(level).name}: {message}", file=stream, flush=True)

    @staticmethod
    def log_info(message: str) -> None:
        Logger.log(message, Logger.INFO)

    @staticmethod
    def log_warn(message: str) -> None:
        Logger.log(message, Logger.WARNING)

    @staticmethod
    def log_error(message: str) -> None:
        Logger.log(message, Logger.ERROR)

    @staticmethod
    def log_verbose(message: str) -> None:
        Logger.log(message, Logger.VERBOSE)


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    return next((t for t in request.inputs() if t.name() == name), None)


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    return next((t for t in response.output_tensors() if t.name() == name), None)


def _by_name(entries: Iterable[Mapping[str, Any]], name: str) -> dict[str, Any] | None:
    return next((dict(e) for e in entries if e.get("name") == name), None)


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _by_name(model_config.get("input", ()), name)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any] | None:
    return _by_name(model_config.get("output", ()), name)


def using_decoupled_model_transaction_policy(model_config: Mapping[str, Any]) -> bool:
    return bool(model_config.get("model_transaction_policy", {}).get("decoupled", False))


def __getattr__(name: str) -> Any:
    """A refused name of Triton's module, reached where the load-time check could not see it."""
    if name in REFUSED_NAMES:
        raise refused_name(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
