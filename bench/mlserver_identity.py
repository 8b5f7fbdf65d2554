"""The identity model as an MLServer runtime, for the peer of scenarios 1-3 (`bench/mlserver_peer.py`).

Imported by MLServer in its own virtual environment (bench/.mlserver-venv), never by mpsd's: it needs
`mlserver`. Like mpsd's identity models (`bench/models.py`), it takes the input as an array and answers with
a copy of it, named OUTPUT, of the same datatype and shape; MLServer's own codec turns the request's raw bytes
into the array and the array back into raw bytes in the reply (the client's request carries
raw_input_contents, so MLServer answers with raw_output_contents).
"""

from __future__ import annotations

from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class IdentityRuntime(MLModel):  # type: ignore[misc]
    """Echoes its one input as OUTPUT."""

    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        array = NumpyCodec.decode_input(payload.inputs[0])
        output = NumpyCodec.encode_output("OUTPUT", array.copy())
        return InferenceResponse(model_name=self.name, id=payload.id, outputs=[output])
