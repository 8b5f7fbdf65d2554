"""Python models: `<version>/model.py` defines `class Model(config, device)` with `infer(inputs) -> outputs`
(a function or an `async def`), or, for a decoupled model, an `infer` that yields its outputs one response at
a time (a generator or an async generator). A `Model.__init__` that also takes `models` gets the calls to
the repository's other models (mpsd.worker.calls). An `infer` with a second argument (`infer(inputs,
parameters)`) gets the request's own parameters there, as a dict (empty when it has none): requests with
other parameters are never batched together.

Inputs are torch tensors, and numpy arrays of bytes for strings (TYPE_STRING); outputs may be torch
tensors or numpy arrays, and strings as numpy arrays or lists of bytes or str (mpsd.worker.strings).
A Triton python-backend model (`class TritonPythonModel`) runs through `triton_python.TritonModel`.

This runs the repository's own code in the worker: the repository is trusted code.
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from collections.abc import Generator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.ipc.strings import DATATYPE as STRINGS
from mpsd.worker import triton_utils
from mpsd.worker.backends.base import Parameters
from mpsd.worker.backends.triton_python import TritonModel, check_model
from mpsd.worker.calls import current
from mpsd.worker.strings import Value, as_strings

TRITON_UTILS = "triton_python_backend_utils"


class PythonBackend:
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self._input_names = [i.name for i in spec.inputs]
        self._output_names = [o.name for o in spec.outputs]
        self._string_outputs = {o.name for o in spec.outputs if o.datatype == STRINGS}
        module_name = f"mpsd_model_{spec.name}_{spec.version}".replace("-", "_").replace(".", "_")
        loader_spec = importlib.util.spec_from_file_location(module_name, spec.model_path)
        if loader_spec is None or loader_spec.loader is None:
            raise ImportError(f"cannot import {spec.model_path}")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules.setdefault(TRITON_UTILS, triton_utils)  # what a Triton python model imports
        loader_spec.loader.exec_module(module)
        model_cls = getattr(module, "Model", None)
        triton_cls = getattr(module, "TritonPythonModel", None)
        self.calls_models = False  # a model that calls others gets no default warm-up (see worker.main)
        if model_cls is not None:
            self.calls_models = _takes(model_cls, "models")
            extra = {"models": current()} if self.calls_models else {}
            self._model = model_cls(asdict(spec), device, **extra)
        elif triton_cls is not None:
            # Triton runs no default warm-up, and a model may call others (`exec`) from its first request.
            self.calls_models = True
            check_model(triton_cls, Path(spec.model_path).read_text(), spec)
            self._model = TritonModel(triton_cls(), spec, device)
        else:
            raise AttributeError(f"{spec.model_path} defines no class Model (nor Triton's TritonPythonModel)")
        self._loop: asyncio.AbstractEventLoop | None = None  # runs an `async def infer`
        self._reads_parameters = _positional(self._model.infer) >= 2

    def compile(self, mode: str, dynamic: bool | None) -> None:
        """torch.compile the model's `infer` (optimization.compile); it compiles on its first calls."""
        self._model.infer = torch.compile(self._model.infer, mode=mode, dynamic=dynamic)

    def _infer(self, inputs: Sequence[Value], parameters: Parameters | None = None) -> Any:
        """The model's infer; an `async def` one run to its end on this backend's event loop."""
        named = dict(zip(self._input_names, inputs, strict=True))
        if self._reads_parameters:
            result = self._model.infer(named, dict(parameters or {}))
        else:
            result = self._model.infer(named)
        if inspect.iscoroutine(result):
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
            result = self._loop.run_until_complete(result)
        return result

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        return self.with_parameters(inputs, None)

    def with_parameters(self, inputs: Sequence[Value], parameters: Parameters | None) -> dict[str, Value]:
        result = self._infer(inputs, parameters)
        if inspect.isgenerator(result) or inspect.isasyncgen(result):
            _responses(result).close()
            raise ValueError("Model.infer yields responses: set model_transaction_policy.decoupled")
        return self._named(result)

    def stream(
        self, inputs: Sequence[Value], parameters: Parameters | None = None
    ) -> Generator[dict[str, Value], None, None]:
        """A decoupled model's responses, as it yields them; closing this closes the model's generator (its
        `finally` runs). A model whose infer returns a dict answers once."""
        result = self._infer(inputs, parameters)
        if not (inspect.isgenerator(result) or inspect.isasyncgen(result)):
            yield self._named(result)
            return
        parts = _responses(result)
        try:
            for part in parts:
                yield self._named(part)
        finally:
            parts.close()

    def _named(self, result: object) -> dict[str, Value]:
        if not isinstance(result, dict):
            raise ValueError(f"Model.infer returned {type(result).__name__}, expected a dict of tensors")
        missing = [n for n in self._output_names if n not in result]
        if missing:
            raise ValueError(f"Model.infer did not return output(s) {', '.join(missing)}")
        return {n: self._value(n, result[n]) for n in self._output_names}

    def _value(self, name: str, value: object) -> Value:
        if name in self._string_outputs:
            array = as_strings(value)
            if array is None:
                raise ValueError(
                    f"output '{name}' is TYPE_STRING: return a numpy array or a list of bytes or str, "
                    f"not {_kind(value)}"
                )
            return array
        if isinstance(value, torch.Tensor):
            return value
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            return torch.from_numpy(value)
        raise ValueError(
            f"output '{name}' is {_kind(value)}; return a torch tensor or a numpy array of numbers"
        )


def _positional(function: Any) -> int:
    """How many positional arguments `function` takes (0 when it has no signature to read)."""
    try:
        found = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):
        return 0
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return sum(p.kind in kinds for p in found)


def _takes(function: Any, name: str) -> bool:
    """Whether `function` has an argument called `name` (one without a signature to read has not)."""
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


def _kind(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"a numpy array of {value.dtype}"
    return f"a {type(value).__name__}"


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
