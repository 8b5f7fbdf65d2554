"""A ModelInfer response's bytes: the serialized header of a model version's responses is kept, and only the
id and the outputs change from one response to the next."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from mpsd.daemon.dataplane.request import InferResult
from mpsd.ipc.infer_wire import raw_output_parts, varint_bytes
from mpsd.proto import grpc_service_pb2 as pb


def infer_response_parts(
    result: InferResult, request_id: str, in_shm: Collection[str] = ()
) -> tuple[Any, list[bytes]]:
    """The response without its raw_output_contents, and those entries: one per output, in order.

    Outputs written to shared memory (`in_shm`) keep their place with empty raw contents, as Triton's do,
    so clients find every other output at its index.
    """
    response = pb.ModelInferResponse(
        model_name=result.model, model_version=str(result.version), id=request_id
    )
    for out in result.outputs:
        response.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
    return response, [b"" if out.name in in_shm else out.data for out in result.outputs]


_ID_TAG = b"\x1a"  # ModelInferResponse.id: field 3, length-delimited
MAX_TEMPLATES = 1024  # past this many (output shapes that vary from request to request) it starts again


class ResponseTemplates:
    """Serialized ModelInferResponse headers, built once for each model version and output signature.

    A model answers request after request with the same header but for the id: its name, its version and
    each output's name, datatype and shape. The header is kept serialized as the fields before the id and
    those after it (protobuf parses a message's fields in any order, and these are in field order), so a
    response costs two joins instead of a message built and serialized every time.
    """

    def __init__(self) -> None:
        self._known: dict[tuple[object, ...], tuple[bytes, bytes]] = {}

    def __len__(self) -> int:
        return len(self._known)

    def parts(
        self, result: InferResult, request_id: str, in_shm: Collection[str] = ()
    ) -> list[bytes | memoryview]:
        """The serialized response as consecutive pieces, as `raw_output_parts` gives them."""
        if in_shm:  # outputs in the client's shared memory: rare, and their entries are empty
            response, contents = infer_response_parts(result, request_id, in_shm)
            return raw_output_parts(response.SerializeToString(), contents)
        outputs = result.outputs
        key: tuple[object, ...] = (result.model, result.version)
        for out in outputs:
            key += (out.name, out.datatype, out.shape)
        template = self._known.get(key)
        if template is None:
            template = self._learn(key, result)
        before, after = template
        if request_id:
            raw_id = request_id.encode()
            header = b"".join((before, _ID_TAG, varint_bytes(len(raw_id)), raw_id, after))
        else:
            header = before + after
        return raw_output_parts(header, [out.data for out in outputs])

    def _learn(self, key: tuple[object, ...], result: InferResult) -> tuple[bytes, bytes]:
        before = pb.ModelInferResponse(model_name=result.model, model_version=str(result.version))
        after = pb.ModelInferResponse()
        for out in result.outputs:
            after.outputs.add(name=out.name, datatype=out.datatype, shape=out.shape)
        if len(self._known) >= MAX_TEMPLATES:
            self._known.clear()
        template = self._known[key] = (before.SerializeToString(), after.SerializeToString())
        return template
