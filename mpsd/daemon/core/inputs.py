"""Checking a request's tensors against the model's config, in the words a client gets: a client's request
(`api.parse`), an ensemble's step (`core.ensemble`) and a model's call to another model (`core.calls`)
are checked by the same code and answered with the same messages."""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Any

from mpsd.config.model_config import InputConfig, ModelConfig, TensorConfig
from mpsd.daemon.dataplane.request import InputTensor
from mpsd.errors import InvalidArgument, Unimplemented
from mpsd.ipc import strings

MAX_DIMS = 16
MAX_TENSOR_BYTES = 2**63 - 1  # what a signed 64-bit byte count (numpy, torch, the IPC) can hold


def fmt(shape: Any) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def check_input(model: str, cfg: TensorConfig, datatype: str, shape: Sequence[int], max_batch: int) -> None:
    """The input's datatype, then its shape: dims, batch dimension and size, a byte size that fits."""
    name = cfg.name
    if datatype != cfg.wire_datatype:
        raise InvalidArgument(f"input '{name}': expected datatype {cfg.wire_datatype}, got '{datatype[:32]}'")
    if len(shape) > MAX_DIMS:
        raise InvalidArgument(f"input '{name}': shape has {len(shape)} dimensions; the limit is {MAX_DIMS}")
    for d in shape:
        if d < 0:
            raise InvalidArgument(f"input '{name}': shape {fmt(shape)} has a negative dimension")
    elements = 1
    for d in shape:  # zero-sized dims count as 1: the shape must still be representable downstream
        elements *= max(d, 1)
    # A string element takes at least its 4-byte length.
    if elements * (cfg.itemsize or strings.LENGTH_BYTES) > MAX_TENSOR_BYTES:
        raise InvalidArgument(
            f"input '{name}': shape {fmt(shape)} is too large: its byte size overflows 64 bits"
        )
    expected = ([-1] if max_batch > 0 else []) + list(cfg.dims)
    if len(shape) != len(expected) or any(e != -1 and e != s for e, s in zip(expected, shape, strict=True)):
        where = f" plus the batch dimension (max_batch_size {max_batch})" if max_batch > 0 else ""
        raise InvalidArgument(
            f"input '{name}': shape {fmt(shape)} does not match the model's dims {fmt(cfg.dims)}{where}"
        )
    if max_batch > 0:
        if shape[0] > max_batch:
            raise InvalidArgument(
                f"input '{name}': batch size {shape[0]} exceeds max_batch_size {max_batch} of model '{model}'"
            )
        if shape[0] == 0:
            raise InvalidArgument(f"input '{name}': batch size 0 is not allowed")


def unknown_input(model: str, name: str, configured: Iterable[str]) -> InvalidArgument:
    return InvalidArgument(f"unknown input '{name}' for model '{model}' (expected: {', '.join(configured)})")


def check_all_given(model: str, configured: Mapping[str, InputConfig], given: Iterable[str]) -> None:
    """Every input the model needs is given (omitting an optional one is not supported)."""
    seen = set(given)
    missing = [n for n, c in configured.items() if n not in seen and not c.optional]
    if missing:
        raise InvalidArgument(f"missing input(s) {', '.join(missing)} for model '{model}'")
    if any(c.optional and n not in seen for n, c in configured.items()):
        raise Unimplemented(f"model '{model}': omitting optional inputs is not supported by this backend")


def check_output(model: str, name: str, known: Collection[str], named: Sequence[str]) -> None:
    """A requested output: one of the model's, not requested twice (`named`: those before it)."""
    if name not in known:
        raise InvalidArgument(f"unknown output '{name}' for model '{model}' (expected: {', '.join(known)})")
    if name in named:
        raise InvalidArgument(f"output '{name}' is requested twice")


def check_bytes(name: str, datatype: str, shape: Sequence[int], itemsize: int | None, size: int) -> None:
    """`size` bytes hold the input: shape x datatype, or (strings, `check_strings`) as many elements."""
    nbytes = math.prod(shape) * itemsize if itemsize is not None else None
    if nbytes is not None and size != nbytes:
        raise InvalidArgument(
            f"input '{name}': raw content has {size} bytes, expected {nbytes} "
            f"for shape {fmt(shape)} of {datatype}"
        )


def check_strings(name: str, data: bytes | bytearray | memoryview, count: int) -> None:
    """Serialized strings: exactly `count` elements, each whole."""
    try:
        strings.element_ends(data, count)
    except strings.MalformedStrings as exc:
        raise InvalidArgument(f"input '{name}': BYTES data {exc}") from None


def named_inputs(
    model: str, config: ModelConfig, tensors: Sequence[InputTensor]
) -> tuple[tuple[InputTensor, ...], int]:
    """Tensors given by name (a model's call), checked as a client's: names, datatypes, shapes, one batch
    size, their bytes; in config order, with the batch size."""
    configured = config.input_by_name
    max_batch = config.max_batch_size
    seen: dict[str, InputTensor] = {}
    batch: int | None = None
    for t in tensors:
        cfg = configured.get(t.name)
        if cfg is None:
            raise unknown_input(model, t.name, configured)
        if t.name in seen:
            raise InvalidArgument(f"duplicate input '{t.name}'")
        check_input(model, cfg, t.datatype, t.shape, max_batch)
        if max_batch > 0:
            if batch is not None and t.shape[0] != batch:
                raise InvalidArgument(
                    f"input '{t.name}': batch size {t.shape[0]} differs from the other inputs' batch size "
                    f"{batch}"
                )
            batch = t.shape[0]
        assert isinstance(t.data, (bytes, memoryview))
        if cfg.itemsize is None:
            check_strings(t.name, t.data, math.prod(t.shape))
        else:
            check_bytes(t.name, cfg.wire_datatype, t.shape, cfg.itemsize, len(t.data))
        seen[t.name] = t
    check_all_given(model, configured, seen)
    return tuple(seen[n] for n in configured), batch or 1
