"""Turning shared-memory bytes into tensors, running the model and writing the outputs back.

All device work happens on the calling thread (MPS is not thread-safe).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from mpsd.errors import Internal
from mpsd.ipc.protocol import ModelSpec, TensorRef, TensorSpec, WarmupTensor
from mpsd.ipc.shm import Region
from mpsd.worker.backends import Backend
from mpsd.worker.device import synchronize
from mpsd.worker.dtypes import TO_TORCH, datatype_of


def tensor_from_region(region: Region, ref: TensorRef) -> torch.Tensor:
    """A CPU tensor that borrows the region's memory: no copy."""
    dtype = TO_TORCH[ref.datatype]
    if ref.nbytes == 0:
        return torch.empty(ref.shape, dtype=dtype)
    # Through numpy, whose array holds a buffer export for as long as any tensor uses it: the region then
    # cannot be unmapped under the tensor (torch.frombuffer keeps no export, so nothing would stop it).
    flat = torch.from_numpy(np.frombuffer(region.buf, dtype=np.uint8, count=ref.nbytes, offset=ref.offset))
    return flat.view(dtype).reshape(ref.shape)


def check_output(spec: TensorSpec, tensor: torch.Tensor, batched: bool) -> str | None:
    """Why the tensor does not match the configured output, or None when it does."""
    got_type = datatype_of(tensor)
    if got_type != spec.datatype:
        return f"output '{spec.name}': model returned {got_type}, config says {spec.datatype}"
    expected = ((-1,) if batched else ()) + spec.dims
    shape = tuple(tensor.shape)
    if len(shape) != len(expected) or any(e != -1 and e != s for e, s in zip(expected, shape, strict=True)):
        return f"output '{spec.name}': model returned shape {list(shape)}, config dims {list(spec.dims)}" + (
            " (plus the batch dimension)" if batched else ""
        )
    return None


def warmup_inputs(spec: ModelSpec, device: torch.device) -> list[torch.Tensor]:
    """Zero inputs of the configured shapes (variable dims as 1, a batch of 1 when batching)."""
    tensors = []
    for t in spec.inputs:
        shape = ([1] if spec.max_batch_size > 0 else []) + [d if d > 0 else 1 for d in t.dims]
        tensors.append(torch.zeros(shape, dtype=TO_TORCH[t.datatype], device=device))
    return tensors


def sample_tensor(t: WarmupTensor, device: torch.device) -> torch.Tensor:
    """A configured warm-up input: zeros, or random values (uniform [0, 1) floats, small integers)."""
    dtype = TO_TORCH[t.datatype]
    if not t.random:
        return torch.zeros(t.shape, dtype=dtype, device=device)
    if dtype.is_floating_point:
        values = torch.rand(t.shape)
    else:
        values = torch.randint(0, 2 if dtype == torch.bool else 8, t.shape)
    return values.to(dtype).to(device)


def _warmup_runs(spec: ModelSpec, device: torch.device) -> Iterator[tuple[str, list[torch.Tensor]]]:
    if not spec.warmup:
        yield "warm-up", warmup_inputs(spec, device)
    for sample in spec.warmup:
        for _ in range(sample.count):
            yield f"warm-up '{sample.name}'", [sample_tensor(t, device) for t in sample.inputs]


def run_warmup(spec: ModelSpec, backend: Backend, device: torch.device) -> None:
    """Run the configured samples (else one request of zeros) before READY, checking every output against
    the config (dims, datatype)."""
    for label, inputs in _warmup_runs(spec, device):
        with torch.inference_mode():
            outputs = backend(inputs)
            synchronize(device)
        problems = [
            p
            for o in spec.outputs
            if (p := check_output(o, outputs[o.name], spec.max_batch_size > 0)) is not None
        ]
        if problems:
            raise ValueError(f"{label}: " + "; ".join(problems))


class Runner:
    """Runs requests for one loaded model on one device."""

    def __init__(self, spec: ModelSpec, backend: Backend, device: torch.device) -> None:
        self.spec = spec
        self.backend = backend
        self.device = device
        self._outputs = {o.name: o for o in spec.outputs}
        self._batched = spec.max_batch_size > 0

    def compute(self, region: Region, refs: Sequence[TensorRef]) -> tuple[dict[str, torch.Tensor], int, int]:
        """Build inputs (zero-copy on CPU), run the model; returns CPU outputs and input/infer times."""
        t0 = time.perf_counter_ns()
        inputs = [tensor_from_region(region, r).to(self.device, non_blocking=True) for r in refs]
        t1 = time.perf_counter_ns()
        with torch.inference_mode():
            try:
                outputs = self.backend(inputs)
            except BaseException:
                # Copies from the (page-locked) region may still be running: let them finish before the
                # region can be reused or unmapped. A failing device must not hide the model's error.
                with contextlib.suppress(Exception):
                    synchronize(self.device)
                raise
            synchronize(self.device)
        del inputs
        t2 = time.perf_counter_ns()
        return outputs, t1 - t0, t2 - t1

    def prepare_outputs(self, outputs: dict[str, torch.Tensor], names: Sequence[str]) -> list[torch.Tensor]:
        """Requested outputs as contiguous CPU tensors, each checked against its config."""
        prepared = []
        for name in names:
            tensor = outputs[name]
            problem = check_output(self._outputs[name], tensor, self._batched)
            if problem is not None:
                raise Internal(problem)
            prepared.append(tensor.detach().to("cpu").contiguous())
        return prepared


def write_outputs(
    region: Region, names: Sequence[str], tensors: Sequence[torch.Tensor]
) -> tuple[TensorRef, ...]:
    """Copy each output into the region once, back to back, and describe where it went."""
    refs = []
    offset = 0
    for name, tensor in zip(names, tensors, strict=True):
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            dst = torch.frombuffer(region.buf, dtype=torch.uint8, count=nbytes, offset=offset)
            dst.copy_(tensor.reshape(-1).view(torch.uint8))
            del dst
        refs.append(TensorRef(name, datatype_of(tensor), tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return tuple(refs)
