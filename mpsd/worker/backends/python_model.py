"""Python models: `<version>/model.py` defines `class Model(config, device)` with `infer(inputs) -> outputs`,
or, for a decoupled model, an `infer` that yields its outputs one response at a time (a generator or an async
generator).

This runs the repository's own code in the worker: the repository is trusted code.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from collections.abc import Generator, Sequence
from dataclasses import asdict
from typing import Any

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
        if inspect.isgenerator(result) or inspect.isasyncgen(result):
            _responses(result).close()
            raise ValueError("Model.infer yields responses: set model_transaction_policy.decoupled")
        return self._named(result)

    def stream(self, inputs: Sequence[torch.Tensor]) -> Generator[dict[str, torch.Tensor], None, None]:
        """A decoupled model's responses, as it yields them; closing this closes the model's generator (its
        `finally` runs). A model whose infer returns a dict answers once."""
        result = self._model.infer(dict(zip(self._input_names, inputs, strict=True)))
        if not (inspect.isgenerator(result) or inspect.isasyncgen(result)):
            yield self._named(result)
            return
        parts = _responses(result)
        try:
            for part in parts:
                yield self._named(part)
        finally:
            parts.close()

    def _named(self, result: object) -> dict[str, torch.Tensor]:
        if not isinstance(result, dict):
            raise ValueError(f"Model.infer returned {type(result).__name__}, expected a dict of tensors")
        missing = [n for n in self._output_names if n not in result]
        if missing:
            raise ValueError(f"Model.infer did not return output(s) {', '.join(missing)}")
        return {n: result[n] for n in self._output_names}


def _responses(result: Any) -> Generator[Any, None, None]:
    """A generator's items; an async generator's too, driven on a private event loop (the worker has no
    loop of its own). Closing this closes the model's generator."""
    if inspect.isgenerator(result):
        try:
            yield from result
        finally:
            result.close()
        return
    loop = asyncio.new_event_loop()
    try:
        while True:
            try:
                item = loop.run_until_complete(result.__anext__())
            except StopAsyncIteration:
                return
            yield item
    finally:
        loop.run_until_complete(result.aclose())
        loop.close()
