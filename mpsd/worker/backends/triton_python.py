"""Triton python-backend models (`class TritonPythonModel` with `initialize(args)`, `execute(requests)`,
`finalize()`), run as mpsd python models: `TritonModel.infer` is the `Model.infer` of mpsd's interface.

Each execution is one Triton request holding the whole batch the daemon formed (dynamic batching merges
requests before the worker), which a model that loops over `requests` handles as it handles any. A
decoupled model's responses go through its response sender into a queue that the worker streams from
until the final flag, whether `execute` sends them itself or from a thread of its own.
"""

from __future__ import annotations

import atexit
import inspect
import json
from collections.abc import Generator, Mapping
from pathlib import Path
from typing import Any

import torch

from mpsd.errors import ErrorCode, MpsdError, Unimplemented
from mpsd.ipc.dtypes import wire_to_config
from mpsd.ipc.protocol import ModelSpec, TensorSpec
from mpsd.worker import triton_utils as pb
from mpsd.worker.strings import Value
from mpsd.worker.triton_config import check_auto_complete
from mpsd.worker.triton_refused import refusals

# How long a decoupled model may go without sending a response before its request fails.
RESPONSE_TIMEOUT_S = 600.0


def model_config(spec: ModelSpec) -> dict[str, Any]:
    """The model's config as Triton hands it to `initialize` (`args["model_config"]`, as JSON)."""

    def tensor(t: TensorSpec) -> dict[str, Any]:
        return {"name": t.name, "data_type": wire_to_config(t.datatype), "dims": list(t.dims)}

    config = {
        "name": spec.name,
        "backend": "python",
        "max_batch_size": spec.max_batch_size,
        "input": [tensor(t) for t in spec.inputs],
        "output": [tensor(t) for t in spec.outputs],
        "parameters": {key: {"string_value": value} for key, value in spec.parameters.items()},
        "model_transaction_policy": {"decoupled": spec.decoupled},
    }
    if spec.dynamic_batching:
        config["dynamic_batching"] = {}
    if spec.sequence:
        config["sequence_batching"] = {}
    return config


def check_model(model_class: type, source: str, spec: ModelSpec) -> None:
    """Refuse at load a model that uses what mpsd does not provide of Triton's module, or whose
    auto_complete_config would change its config (Unimplemented, naming each and why)."""
    found = [f"{spec.model_path} {refusal}" for refusal in refusals(source, spec.sequence)]
    if found:
        raise Unimplemented("; ".join(found))
    try:
        check_auto_complete(model_class, model_config(spec))
    except ValueError as exc:
        raise Unimplemented(f"{spec.model_path}: {exc}") from None


# Triton's error codes (TritonError's) as mpsd's: what a client gets for an error response.
_CODES = {triton: mpsd for mpsd, triton in pb.CODES.items()}


def _failed(error: pb.TritonError) -> MpsdError:
    return MpsdError(error.message(), _CODES.get(error.code(), ErrorCode.INTERNAL))


class TritonModel:
    def __init__(self, model: Any, spec: ModelSpec, device: torch.device) -> None:
        self.model = model
        self.outputs = [o.name for o in spec.outputs]
        self.decoupled = spec.decoupled
        args = {
            "model_config": json.dumps(model_config(spec)),
            "model_instance_kind": "GPU" if device.type != "cpu" else "CPU",
            "model_instance_name": f"{spec.name}_0",
            "model_instance_device_id": str(device.index or 0),
            "model_repository": str(Path(spec.model_path).parent.parent),
            "model_version": str(spec.version),
            "model_name": spec.name,
        }
        initialize = getattr(model, "initialize", None)
        if initialize is not None:
            initialize(args)
        finalize = getattr(model, "finalize", None)
        if finalize is not None:
            atexit.register(finalize)  # the worker's exit is the model's unload

    def infer(self, inputs: Mapping[str, Value], parameters: Mapping[str, Any]) -> Any:
        tensors = [pb.Tensor(name, value) for name, value in inputs.items()]
        request = pb.InferenceRequest.received(tensors, self.outputs, parameters, self.decoupled)
        sender = request.get_response_sender() if self.decoupled else None
        try:
            responses = self.model.execute([request])
        except (pb.TritonModelException, pb.TritonError) as exc:
            raise self._raised(exc) from None
        if inspect.iscoroutine(responses):  # `async def execute` (which may await `async_exec`)
            return self._finish_async(responses, sender)
        return self._finish(responses, sender)

    async def _finish_async(self, pending: Any, sender: pb.InferenceResponseSender | None) -> Any:
        try:
            responses = await pending
        except (pb.TritonModelException, pb.TritonError) as exc:
            raise self._raised(exc) from None
        return self._finish(responses, sender)

    @staticmethod
    def _raised(exc: pb.TritonModelException | pb.TritonError) -> MpsdError:
        """The request's failure for what `execute` raised: its message is the client's, as in Triton."""
        if isinstance(exc, pb.TritonError):
            return _failed(exc)
        return MpsdError(str(exc), ErrorCode.INTERNAL)

    def _finish(self, responses: Any, sender: pb.InferenceResponseSender | None) -> Any:
        if sender is not None:
            return self._stream(sender)
        if responses is None or len(responses) != 1:
            count = "none" if responses is None else len(responses)
            raise ValueError(f"TritonPythonModel.execute returned {count} responses for 1 request")
        return self._outputs(responses[0])

    @staticmethod
    def _outputs(response: pb.InferenceResponse) -> dict[str, Any]:
        error = response.error()
        if error is not None:
            raise _failed(error)
        return {t.name(): t.value for t in response.output_tensors()}

    def _stream(self, sender: pb.InferenceResponseSender) -> Generator[dict[str, Any], None, None]:
        while True:
            response, flags = sender.sent.get(timeout=RESPONSE_TIMEOUT_S)
            if response is not None:
                yield self._outputs(response)
            if flags & pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                return
