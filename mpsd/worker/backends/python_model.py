"""Python models: `<version>/model.py` defines `class Model(config, device)` with `infer(inputs) -> outputs`.

This runs the repository's own code in the worker: the repository is trusted code.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import asdict

import torch

from mpsd.ipc.protocol import ModelSpec


class PythonBackend:
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self._input_names = [i.name for i in spec.inputs]
        self._output_names = [o.name for o in spec.outputs]
        module_name = f"mpsd_model_{spec.name}_{spec.version}".replace("-", "_").replace(".", "_")
        loader_spec = importlib.util.spec_from_file_location(module_name, spec.model_path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot import {spec.model_path}")
        module = importlib.util.module_from_spec(loader_spec)
        loader_spec.loader.exec_module(module)
        model_cls = getattr(module, "Model", None)
        if model_cls is None:
            raise AttributeError(f"{spec.model_path} defines no class Model")
        self._model = model_cls(asdict(spec), device)

    def compile(self, mode: str, dynamic: bool | None) -> None:
        """torch.compile the model's `infer` (optimization.compile); it compiles on its first calls."""
        self._model.infer = torch.compile(self._model.infer, mode=mode, dynamic=dynamic)

    def __call__(self, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        result = self._model.infer(dict(zip(self._input_names, inputs, strict=True)))
        if not isinstance(result, dict):
            raise ValueError(f"Model.infer returned {type(result).__name__}, expected a dict of tensors")
        missing = [n for n in self._output_names if n not in result]
        if missing:
            raise ValueError(f"Model.infer did not return output(s) {', '.join(missing)}")
        return {n: result[n] for n in self._output_names}
