"""`optimization.compile`: torch.compile a torch_export or python model at load, and compile it during
warm-up at the batch sizes the config allows, so that no client request pays for a compilation.

torch.compile compiles lazily, on the first call at each new input shape; the warm-up here makes those
calls (zeros at each of `compile_batch_sizes`, or the one warm-up request of a model without batching),
and its time is the compile time the worker reports as Ready.compile_ms.
"""

from __future__ import annotations

import time

import torch

from mpsd.ipc.protocol import ModelSpec, WarmupTensor
from mpsd.worker.backends import Backend
from mpsd.worker.device import synchronize
from mpsd.worker.strings import Value
from mpsd.worker.warmup import bucket_shapes, sample_value, warmup_inputs


def compile_backend(backend: Backend, spec: ModelSpec) -> None:
    """Wrap the backend's model in torch.compile (the config allows only backends that can be)."""
    assert spec.compile_mode is not None
    compile_model = getattr(backend, "compile", None)
    if compile_model is None:
        raise ValueError(f"optimization.compile: a {spec.backend} model cannot be compiled")
    compile_model(spec.compile_mode, spec.compile_dynamic)


def compile_inputs(spec: ModelSpec, device: torch.device, batch: int) -> list[Value]:
    """Zeros (empty strings) of the configured shapes at one batch size (variable dims as 1)."""
    return [
        sample_value(WarmupTensor(t.name, t.datatype, (batch, *(d if d > 0 else 1 for d in t.dims))), device)
        for t in spec.inputs
    ]


def _compile_runs(spec: ModelSpec, device: torch.device) -> list[list[Value]]:
    """The inputs compiled at: each compile batch size (or the one warm-up request) at each bucket."""
    if spec.buckets:
        sizes = spec.compile_batch_sizes or (1,)
        return [warmup_inputs(spec, device, s, b) for b in sizes for s in bucket_shapes(spec)]
    runs = [compile_inputs(spec, device, b) for b in spec.compile_batch_sizes]
    return runs or [warmup_inputs(spec, device)]


def compile_warmup(spec: ModelSpec, backend: Backend, device: torch.device) -> float:
    """Run the model at every compile batch size; returns the milliseconds it took (the compile time)."""
    t0 = time.perf_counter()
    runs = _compile_runs(spec, device)
    with torch.inference_mode():
        for inputs in runs:
            backend(inputs)
            synchronize(device)
    return (time.perf_counter() - t0) * 1e3
