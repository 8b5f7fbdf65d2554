"""torch.export programs (`model.pt2` written by torch.export.save)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends.base import map_outputs
from mpsd.worker.strings import Value


class TorchExportBackend:
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self._names = [o.name for o in spec.outputs]
        program = torch.export.load(spec.model_path)
        module = program.module()
        self._module: Callable[..., Any] = module.to(device)

    def compile(self, mode: str, dynamic: bool | None) -> None:
        """torch.compile the program's module (optimization.compile); it compiles on its first calls."""
        self._module = torch.compile(self._module, mode=mode, dynamic=dynamic)

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        return map_outputs(self._module(*inputs), self._names)
