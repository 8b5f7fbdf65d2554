"""`triton_python_backend_utils` for Triton python-backend models: the part of that module's API such a
model uses to read its requests and write its responses, so that a Triton `model.py` (`class
TritonPythonModel` with `initialize`, `execute`, `finalize`) runs in an mpsd worker unchanged.

The worker registers this module under Triton's name before it imports the model. What is here, and what
is not, is listed in docs/triton-python-models.md.
"""

from __future__ import annotations

import json
import queue
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.utils.dlpack

from mpsd.errors import ErrorCode
from mpsd.worker import calls

TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
# Triton's config data types, as numpy types (its triton_string_to_numpy).
_NUMPY = {
    "TYPE_BOOL": np.bool_,
    "TYPE_UINT8": np.uint8,
    "TYPE_UINT16": np.uint16,
    "TYPE_UINT32": np.uint32,
    "TYPE_UINT64": np.uint64,
    "TYPE_INT8": np.int8,
    "TYPE_INT16": np.int16,
    "TYPE_INT32": np.int32,
    "TYPE_INT64": np.int64,
    "TYPE_FP16": np.float16,
    "TYPE_FP32": np.float32,
    "TYPE_FP64": np.float64,
    "TYPE_STRING": np.object_,
}


class TritonError(Exception):
    """An error a model reports in a response (`InferenceResponse(error=...)`) or raises."""

    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = INTERNAL) -> None:
        super().__init__(message)
        self._message = message
        self._code = code

    def message(self) -> str:
        return self._message

    def code(self) -> int:
        return self._code


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

    def to_dlpack(self) -> Any:
        return torch.as_tensor(self._value).__dlpack__()

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


class InferenceRequest:
    """One request as `execute` sees it (its input tensors: a whole batch of the daemon's), or one a model
    makes to call another model (`model_name`, then `exec()`, through mpsd.worker.calls)."""

    def __init__(
        self,
        inputs: Sequence[Tensor] = (),
        requested_output_names: Sequence[str] = (),
        request_id: str = "",
        parameters: Mapping[str, Any] | None = None,
        sender: InferenceResponseSender | None = None,
        *,
        model_name: str = "",
        model_version: int = -1,
        timeout: int = 0,
        **_: Any,  # Triton's flags, correlation_id, preferred_memory, trace: nothing to do with them here
    ) -> None:
        self._inputs = list(inputs)
        self._outputs = list(requested_output_names)
        self._id = request_id
        self._parameters = dict(parameters or {})
        self._sender = sender
        self._model = model_name
        self._version = str(model_version) if model_version > 0 else ""
        self._timeout_s = timeout / 1e6 if timeout > 0 else None  # Triton's timeout is in microseconds

    def inputs(self) -> list[Tensor]:
        return list(self._inputs)

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def request_id(self) -> str:
        return self._id

    def parameters(self) -> str:
        return json.dumps(self._parameters)

    def get_response_sender(self) -> InferenceResponseSender:
        if self._sender is None:
            raise TritonError("get_response_sender is for decoupled models (model_transaction_policy)")
        return self._sender

    def is_cancelled(self) -> bool:
        return False

    def _call(self) -> tuple[str, dict[str, Any], dict[str, Any]]:
        inputs = {t.name(): t.value for t in self._inputs}
        options = {
            "version": self._version,
            "outputs": self._outputs,
            "timeout_s": self._timeout_s,
            "request_id": self._id,
        }
        return self._model, inputs, options

    def exec(self, decoupled: bool = False) -> Any:
        """Call `model_name` (Triton's BLS): its response, carrying the error if the call failed; with
        `decoupled`, an iterator of its responses."""
        model, inputs, options = self._call()
        if decoupled:
            return _responses(calls.current().stream(model, inputs, **options))
        try:
            return _response(calls.current().infer(model, inputs, **options))
        except calls.CallError as exc:
            return InferenceResponse(error=_error(exc))

    async def async_exec(self, decoupled: bool = False) -> Any:
        model, inputs, options = self._call()
        if decoupled:
            return _responses(calls.current().stream(model, inputs, **options))
        try:
            return _response(await calls.current().infer_async(model, inputs, **options))
        except calls.CallError as exc:
            return InferenceResponse(error=_error(exc))


# mpsd's error codes as Triton's (TritonError's codes).
_CODES = {
    ErrorCode.NOT_FOUND: TritonError.NOT_FOUND,
    ErrorCode.INVALID_ARGUMENT: TritonError.INVALID_ARG,
    ErrorCode.UNAVAILABLE: TritonError.UNAVAILABLE,
    ErrorCode.UNIMPLEMENTED: TritonError.UNSUPPORTED,
    ErrorCode.ALREADY_EXISTS: TritonError.ALREADY_EXISTS,
    ErrorCode.CANCELLED: TritonError.CANCELLED,
}


def _error(exc: calls.CallError) -> TritonError:
    return TritonError(exc.message, _CODES.get(exc.code, TritonError.INTERNAL))


def _response(outputs: Mapping[str, Any]) -> InferenceResponse:
    return InferenceResponse([Tensor(name, value) for name, value in outputs.items()])


def _responses(stream: Any) -> Iterator[InferenceResponse]:
    """A decoupled call's responses; a failure ends them with a response carrying the error."""
    with stream:
        try:
            for outputs in stream:
                yield _response(outputs)
        except calls.CallError as exc:
            yield InferenceResponse(error=_error(exc))


class InferenceResponse:
    def __init__(self, output_tensors: Sequence[Tensor] = (), error: TritonError | None = None) -> None:
        self._outputs = list(output_tensors)
        self._error = error

    def output_tensors(self) -> list[Tensor]:
        return list(self._outputs)

    def has_error(self) -> bool:
        return self._error is not None

    def error(self) -> TritonError | None:
        return self._error


class InferenceResponseSender:
    """A decoupled model's sender: responses go into a queue the worker streams from, until a final flag."""

    def __init__(self) -> None:
        self.sent: queue.Queue[tuple[InferenceResponse | None, int]] = queue.Queue()

    def send(self, response: InferenceResponse | None = None, flags: int = 0) -> None:
        self.sent.put((response, flags))

    def is_cancelled(self) -> bool:
        return False


def get_input_tensor_by_name(request: InferenceRequest, name: str) -> Tensor | None:
    for tensor in request.inputs():
        if tensor.name() == name:
            return tensor
    return None


def get_output_tensor_by_name(response: InferenceResponse, name: str) -> Tensor | None:
    for tensor in response.output_tensors():
        if tensor.name() == name:
            return tensor
    return None


def _by_name(entries: Iterable[Mapping[str, Any]], name: str) -> dict[str, Any]:
    for entry in entries:
        if entry.get("name") == name:
            return dict(entry)
    return {}


def get_input_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _by_name(model_config.get("input", ()), name)


def get_output_config_by_name(model_config: Mapping[str, Any], name: str) -> dict[str, Any]:
    return _by_name(model_config.get("output", ()), name)


def triton_string_to_numpy(triton_type: str) -> Any:
    return _NUMPY[triton_type]


def numpy_to_triton_type(dtype: Any) -> str:
    for name, np_type in _NUMPY.items():
        if np.dtype(np_type) == np.dtype(dtype):
            return name
    raise TritonError(f"no Triton type for numpy {dtype}")
