"""String tensors in the worker: what a python model gets and may return for a BYTES input or output.

A model gets a numpy array of `bytes` objects (dtype object), as Triton's python backend gives it; it may
return such an array, an array of `str` or fixed-width bytes, or a (nested) list of `bytes` or `str` (text
is encoded as UTF-8). On their way out they are serialized once (mpsd.ipc.strings), for the daemon.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from mpsd.ipc import strings

Strings = npt.NDArray[np.object_]
# What a model takes and returns for one tensor: a torch tensor, or strings.
Value = torch.Tensor | Strings


def to_array(data: bytes | memoryview, shape: tuple[int, ...]) -> Strings:
    """Serialized elements as an array of bytes objects of `shape`."""
    array = np.empty(math.prod(shape), dtype=np.object_)
    array[:] = strings.split(data, len(array))
    return array.reshape(shape)


def as_strings(value: object) -> Strings | None:
    """A model's string result as an array of bytes objects; None when it is not strings (a tensor, or an
    array of numbers)."""
    if isinstance(value, (list, tuple)):
        value = np.array(value, dtype=np.object_)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in "OSU":
        return None
    out = np.empty(value.shape, dtype=np.object_)
    flat = out.reshape(-1)
    for i, element in enumerate(value.reshape(-1)):
        flat[i] = _element(element)
    return out


def _element(element: Any) -> bytes:
    if isinstance(element, bytes):
        return element
    if isinstance(element, str):
        return element.encode("utf-8")
    if isinstance(element, np.bytes_):
        return bytes(element)
    raise TypeError(f"a string output holds a {type(element).__name__}; expected bytes or str")


@dataclass(frozen=True)
class StringTensor:
    """A string output on its way to the daemon: its shape and its serialized elements."""

    shape: tuple[int, ...]
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)

    @classmethod
    def of(cls, array: Strings) -> StringTensor:
        return cls(tuple(array.shape), strings.serialize(array.reshape(-1).tolist()))


def sample(shape: tuple[int, ...], random: bool) -> Strings:
    """A warm-up input of strings: empty ones (zero_data) or short random ASCII words (random_data)."""
    count = math.prod(shape)
    elements = [os.urandom(4).hex().encode() for _ in range(count)] if random else [b""] * count
    array = np.empty(count, dtype=np.object_)
    array[:] = elements
    return array.reshape(shape)


def tensors_of(values: Sequence[Value]) -> list[torch.Tensor]:
    """The inputs of a model that takes tensors only (config validation keeps strings from it)."""
    for value in values:
        if not isinstance(value, torch.Tensor):
            raise TypeError("a string input reached a model that takes tensors only")
    return list(values)  # type: ignore[arg-type]


def tensor_outputs(outputs: Mapping[str, Value]) -> dict[str, torch.Tensor]:
    """The outputs of a model that returns tensors only."""
    return dict(zip(outputs, tensors_of(list(outputs.values())), strict=True))
