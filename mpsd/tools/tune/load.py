"""The load of one trial: `concurrency` clients, each sending its next request as soon as the previous
one is answered (a closed loop), on threads over one gRPC channel; a warm-up first, then a window of
`duration` seconds in which every completion counts.

Requests carry one sample each: generated from the model's metadata (random floats, zeros for integers,
`--shape` where a dimension is variable), or the values given with `--input` (as `mpsd infer` reads them:
JSON, a number, or @file.npy)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from mpsd.ipc import strings
from mpsd.tools.common import ToolError
from mpsd.tools.infer import NUMPY, TensorMeta, encode, read_value, split_assignment

SHAPE_HINT = (
    "give --shape NAME=1,3,224,224 (the whole request's shape, batch first) or --input NAME=@file.npy"
)


def parse_shapes(texts: Sequence[str]) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for text in texts:
        name, sep, dims = text.partition("=")
        try:
            shape = tuple(int(d) for d in dims.split(","))
        except ValueError:
            shape = ()
        if not sep or not name or not shape or min(shape) < 1:
            raise ToolError(f"--shape {text!r}: expected NAME=D1,D2,... with whole numbers >= 1", SHAPE_HINT)
        shapes[name] = shape
    return shapes


def _generated(meta: TensorMeta, batching: bool, shape: tuple[int, ...] | None) -> np.ndarray[Any, Any]:
    if shape is None:
        dims = [1 if batching and i == 0 else d for i, d in enumerate(meta.shape)]
        if any(d < 0 for d in dims):
            raise ToolError(f"input '{meta.name}' has a variable dimension {list(meta.shape)}", SHAPE_HINT)
        shape = tuple(dims)
    if meta.datatype == strings.DATATYPE:
        return np.full(shape, "x", dtype=np.str_)
    if meta.datatype in ("FP16", "FP32", "FP64", "BF16"):
        return np.random.default_rng(0).random(shape).astype(np.float32)
    return np.zeros(shape, dtype=NUMPY[meta.datatype])


def build_request(
    model: str, metas: Sequence[TensorMeta], batching: bool, values: Sequence[str], shapes: Sequence[str]
) -> Any:
    """One ModelInferRequest every client sends."""
    from mpsd.proto import grpc_service_pb2 as pb

    given = dict(split_assignment(v) for v in values)
    by_shape = parse_shapes(shapes)
    known = {m.name for m in metas}
    for name in [*given, *by_shape]:
        if name not in known:
            raise ToolError(f"the model has no input '{name}'", f"its inputs are: {', '.join(sorted(known))}")
    request = pb.ModelInferRequest(model_name=model)
    for meta in metas:
        if meta.name in given:
            array = read_value(meta.name, given[meta.name])
        else:
            array = _generated(meta, batching, by_shape.get(meta.name))
        shape, data = encode(meta, array)
        if batching and shape and shape[0] != 1:
            raise ToolError(f"input '{meta.name}' has {shape[0]} rows", "each request carries one sample")
        request.inputs.add(name=meta.name, datatype=meta.datatype, shape=shape)
        request.raw_input_contents.append(data)
    return request


@dataclass(frozen=True)
class LoadResult:
    latencies_s: list[float]  # of the requests completed in the window
    window_s: float
    errors: int  # failed requests, in the warm-up or the window
    error_sample: list[str]

    def percentile_ms(self, q: float) -> float:
        return float(np.percentile(self.latencies_s, q)) * 1000 if self.latencies_s else 0.0


def run_load(
    infer: Callable[..., Any],
    request: Any,
    concurrency: int,
    warmup_s: float,
    duration_s: float,
    timeout_s: float,
    at_window: Callable[[str], None] = lambda edge: None,
) -> LoadResult:
    """Drive `infer` (the stub's ModelInfer) from `concurrency` threads; `at_window("start")` and
    `("end")` are called at the window's edges (the batch statistics are read there)."""
    stop = threading.Event()
    lock = threading.Lock()
    done: list[tuple[float, float]] = []  # (completion time, latency)
    errors: list[str] = []

    def client() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                infer(request, timeout=timeout_s)
            except grpc.RpcError as exc:
                with lock:
                    errors.append(f"{exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]
                continue
            ended = time.perf_counter()
            with lock:
                done.append((ended, ended - started))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for t in threads:
        t.start()
    try:
        stop.wait(warmup_s)
        at_window("start")
        begin = time.perf_counter()
        stop.wait(duration_s)
        end = time.perf_counter()
        at_window("end")
    finally:
        stop.set()
        for t in threads:
            t.join()
    latencies = [lat for at, lat in done if begin <= at <= end]
    return LoadResult(latencies, end - begin, len(errors), sorted(set(errors))[:3])
