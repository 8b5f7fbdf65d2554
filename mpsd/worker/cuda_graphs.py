"""CUDA graphs: a model's kernels recorded once per batch size (and shape bucket), then replayed with one
launch.

A batched model on a fast GPU is often bound by the CPU thread that launches its kernels one by one
(ResNet-50 in fp16: over a hundred per call, each a few microseconds of Python and driver work). Replaying a
recorded graph skips that. Each graph owns static input and output tensors: a batch is copied into the
inputs of the smallest graph that holds it, and its rows of the outputs come back as views, valid until the
next call. The padding rows keep whatever an earlier batch left there; rows do not affect each other, which
dynamic batching already assumes. A model with shape buckets gets one graph per batch size and bucket: the
daemon pads each bucketed dim to one of its sizes, so every batch that fits a recorded size has a graph.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mpsd.ipc.protocol import ModelSpec, WarmupTensor
from mpsd.worker.backends import Backend
from mpsd.worker.strings import Value, tensor_outputs, tensors_of
from mpsd.worker.warmup import bucket_shapes, sample_tensor, warmup_inputs

# Calls on a side stream before a recording: lazy set-up (cuBLAS workspaces, cuDNN plans, the TorchScript
# executor's profiling runs) must happen before it, as none of it can be recorded.
WARMUP_CALLS = 3


def graph_size(sizes: Sequence[int], rows: int) -> int | None:
    """The smallest recorded batch size (`sizes` ascending) that holds `rows`, or None: run without one."""
    i = bisect.bisect_left(sizes, rows)
    return sizes[i] if i < len(sizes) else None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: dict[str, torch.Tensor]


class GraphedBackend:
    """A backend that replays a recorded graph for every batch that fits one, and calls the model directly
    for the rest (batches larger than every recorded size, inputs of other shapes).

    Inputs come as device tensors (copied on the worker's copy stream) and go into the graph's inputs on the
    model's stream, where the execution before has finished with them.
    """

    def __init__(self, backend: Backend, spec: ModelSpec, device: torch.device) -> None:
        self.backend = backend
        self.device = device
        self.sizes = tuple(sorted(set(spec.cuda_graph_batch_sizes)))
        self._specs = spec.inputs
        self._buckets = spec.buckets
        # (batch size, each bucketed dim's size) -> its graph; without buckets the second part is ()
        self._graphs: dict[tuple[int, tuple[int, ...]], _Graph] = {}
        pool = torch.cuda.graph_pool_handle()
        shapes = bucket_shapes(spec)
        # largest first: the smaller graphs reuse the memory it took
        keys = [(size, bucket) for size in reversed(self.sizes) for bucket in reversed(shapes)]
        for key in keys:
            self._graphs[key] = self._record(spec, device, key, pool)
        for key in keys:
            self._check(key)

    def _record(
        self, spec: ModelSpec, device: torch.device, key: tuple[int, tuple[int, ...]], pool: Any
    ) -> _Graph:
        size, bucket = key
        inputs = tensors_of(warmup_inputs(spec, device, bucket, batch=size))  # no strings: the config's rule
        try:
            side = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_CALLS):
                    self.backend(inputs)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                outputs = tensor_outputs(self.backend(inputs))
        except Exception as exc:
            raise RuntimeError(
                f"recording a CUDA graph at batch size {size}{_at(bucket)} failed "
                f"({type(exc).__name__}: {exc}); "
                "turn optimization.cuda.graphs off for this model"
            ) from exc
        for name, out in outputs.items():
            if out.device.type != device.type:  # made on the host: a replay would hand back recorded values
                raise RuntimeError(
                    f"output '{name}' is on {out.device}, not {device}: a CUDA graph records only the "
                    "model's GPU work; turn optimization.cuda.graphs off for this model"
                )
        return _Graph(graph, inputs, outputs)

    def _check(self, key: tuple[int, tuple[int, ...]]) -> None:
        """Replay on fresh inputs and compare with calling the model: a graph records GPU kernels only, so
        a model whose answers also come from Python state or host values would replay stale ones."""
        recorded = self._graphs[key]
        size, bucket = key
        for t, static in zip(self._specs, recorded.inputs, strict=True):
            random = WarmupTensor(t.name, t.datatype, tuple(static.shape), random=True)
            static.copy_(sample_tensor(random, self.device))
        recorded.graph.replay()
        replayed = {name: out.clone() for name, out in recorded.outputs.items()}
        direct = tensor_outputs(self.backend(recorded.inputs))
        for name, want in direct.items():
            got = replayed.get(name)
            loose = want.dtype in (torch.float16, torch.bfloat16)
            if (
                got is None
                or got.shape != want.shape
                or not torch.allclose(
                    got, want, rtol=1e-2 if loose else 1e-3, atol=1e-2 if loose else 1e-3, equal_nan=True
                )
            ):
                raise RuntimeError(
                    f"the CUDA graph recorded at batch size {size}{_at(bucket)} answers differently from the "
                    f"model for output '{name}' (the model depends on more than its GPU work, such as Python "
                    "state or host values); turn optimization.cuda.graphs off for this model"
                )

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        return self._run(tensors_of(inputs))

    def _run(self, inputs: list[torch.Tensor]) -> dict[str, Value]:
        rows = int(inputs[0].shape[0]) if inputs and inputs[0].dim() else 0
        size = graph_size(self.sizes, rows)
        bucket = tuple(int(inputs[b.input].shape[b.dim]) for b in self._buckets)
        recorded = self._graphs.get((size, bucket)) if size is not None else None
        if recorded is None or any(
            x.shape[1:] != static.shape[1:] for x, static in zip(inputs, recorded.inputs, strict=True)
        ):
            return self.backend([x.to(self.device, non_blocking=True) for x in inputs])
        for static, given in zip(recorded.inputs, inputs, strict=True):
            static[:rows].copy_(given, non_blocking=True)
        recorded.graph.replay()
        if rows == size:
            return dict(recorded.outputs)
        return {name: out[:rows] for name, out in recorded.outputs.items()}


def _at(bucket: tuple[int, ...]) -> str:
    """Where a graph was recorded, past its batch size: its bucket, for a model with shape buckets."""
    return f" and bucket {list(bucket)}" if bucket else ""
