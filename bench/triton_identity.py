"""The identity model for Triton's python backend, for the peer of scenarios 1-3 (`bench/triton_peer.py`).

Copied into Triton's model repository as `<model>/1/model.py` and run by Triton's python backend stub in the
peer's own virtual environment (bench/.triton-venv), never imported by mpsd's: it needs
`triton_python_backend_utils`, which the backend provides. Like mpsd's identity models (`bench/models.py`) and
Triton's own identity example, it answers each request with its INPUT as OUTPUT, of the same datatype and
shape. With dynamic batching Triton hands `execute` several requests at once, each answered on its own.
"""

from __future__ import annotations

from typing import Any

import triton_python_backend_utils as pb_utils  # type: ignore[import-not-found]


class TritonPythonModel:
    """Echoes each request's INPUT as OUTPUT."""

    def execute(self, requests: list[Any]) -> list[Any]:
        responses = []
        for request in requests:
            array = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor("OUTPUT", array)]))
        return responses
