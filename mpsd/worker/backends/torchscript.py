"""TorchScript models (`model.pt` written by torch.jit.save)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends.base import map_outputs
from mpsd.worker.strings import Value


class TorchScriptBackend:
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self._names = [o.name for o in spec.outputs]
        self._module = torch.jit.load(spec.model_path, map_location=device)  # type: ignore[no-untyped-call]
        self._module.eval()
        self._forward = self._module.forward  # straight to the compiled method: no Python hook dispatch

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        return map_outputs(self._forward(*inputs), self._names)
