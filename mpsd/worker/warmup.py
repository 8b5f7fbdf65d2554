"""Warming a model up before it is marked ready: the configured `model_warmup` samples (or one request of
zeros), each output checked against the config, so the first requests pay for no lazy initialisation and a
model whose outputs do not match its config never serves.

Runs on the worker's one device thread, before the runner (`inference.py`) takes requests; `mpsd validate`'s
trial runs the same samples.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mpsd.ipc.protocol import ModelSpec, WarmupTensor
from mpsd.ipc.strings import DATATYPE as STRINGS
from mpsd.worker import strings
from mpsd.worker.backends import Backend
from mpsd.worker.device import synchronize
from mpsd.worker.dtypes import TO_TORCH
from mpsd.worker.inference import OutputMismatch, output_mismatch
from mpsd.worker.strings import Value


@dataclass(frozen=True)
class WarmupMismatch:
    """A warm-up sample (`label`: "warm-up" or "warm-up 'NAME'") whose outputs do not match the config."""

    label: str
    outputs: tuple[OutputMismatch, ...]

    def __str__(self) -> str:
        return f"{self.label}: " + "; ".join(m.message for m in self.outputs)


def warmup_inputs(
    spec: ModelSpec, device: torch.device, bucket: tuple[int, ...] = (), batch: int = 1
) -> list[Value]:
    """Zero inputs (empty strings) of the configured shapes (variable dims as 1, a batch of `batch` when
    batching); `bucket`: each of spec.buckets' dims at that size, and the mask input (the last) all ones."""
    batched = spec.max_batch_size > 0
    shapes = [([batch] if batched else []) + [d if d > 0 else 1 for d in t.dims] for t in spec.inputs]
    for b, size in zip(spec.buckets, bucket, strict=False):
        shapes[b.input][b.dim] = size
    if bucket and spec.mask_follows >= 0:
        b = spec.buckets[spec.mask_follows]
        shapes[-1] = shapes[b.input][: b.dim + 1]
    values: list[Value] = []
    for t, shape in zip(spec.inputs, shapes, strict=True):
        if t.datatype == STRINGS:
            values.append(strings.sample(tuple(shape), random=False))
        else:
            values.append(torch.zeros(shape, dtype=TO_TORCH[t.datatype], device=device))
    if bucket and spec.mask_follows >= 0 and isinstance(values[-1], torch.Tensor):
        values[-1].fill_(1)  # every position real: a mask of zeros is no request's
    return values


def bucket_shapes(spec: ModelSpec) -> list[tuple[int, ...]]:
    """Each combination of the buckets' sizes (one per bucketed dim); [()] for a model without buckets."""
    return list(itertools.product(*(b.sizes for b in spec.buckets)))


def sample_value(t: WarmupTensor, device: torch.device) -> Value:
    """A configured warm-up input: `sample_tensor`, or strings (`strings.sample`)."""
    if t.datatype == STRINGS:
        return strings.sample(t.shape, t.random)
    return sample_tensor(t, device)


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


def _warmup_runs(
    spec: ModelSpec, device: torch.device, default: bool = True
) -> Iterator[tuple[str, list[Value]]]:
    if not spec.warmup and default:
        for bucket in bucket_shapes(spec):  # each shape the daemon pads to: none is met the first time
            yield (
                "warm-up" + (f" at bucket {list(bucket)}" if bucket else ""),
                warmup_inputs(spec, device, bucket),
            )
    for sample in spec.warmup:
        for _ in range(sample.count):
            yield f"warm-up '{sample.name}'", [sample_value(t, device) for t in sample.inputs]


def warmup_mismatch(
    spec: ModelSpec, backend: Backend, device: torch.device, default: bool = True
) -> WarmupMismatch | None:
    """Run the configured samples (else, with `default`, one request of zeros), checking every output
    against the config (dims, datatype); the first sample whose outputs do not match, or None."""
    stream = getattr(backend, "stream", None) if spec.decoupled else None
    for label, inputs in _warmup_runs(spec, device, default):
        with torch.inference_mode():
            # A decoupled model's every response is checked; it may also answer with none.
            responses = list(stream(inputs)) if stream is not None else [backend(inputs)]
            synchronize(device)
        for outputs in responses:
            mismatches = tuple(
                m
                for o in spec.outputs
                if (m := output_mismatch(o, outputs[o.name], spec.max_batch_size > 0)) is not None
            )
            if mismatches:
                return WarmupMismatch(label, mismatches)
    return None


def run_warmup(spec: ModelSpec, backend: Backend, device: torch.device, default: bool = True) -> None:
    """Warm the model up before READY (`default`: with a request of zeros when no sample is configured);
    ValueError (`label: output ...; output ...`) when an output does not match the config."""
    mismatch = warmup_mismatch(spec, backend, device, default)
    if mismatch is not None:
        raise ValueError(str(mismatch))
