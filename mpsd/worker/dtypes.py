"""Protocol datatype names <-> torch dtypes (worker side only; the daemon never imports torch).

The names and dtypes come from the one table, mpsd.ipc.dtypes.DATATYPES.
"""

from __future__ import annotations

import torch

from mpsd.ipc.dtypes import DATATYPES
from mpsd.worker.strings import Value

# Every datatype torch holds (all but BYTES).
TO_TORCH: dict[str, torch.dtype] = {
    name: getattr(torch, d.torch) for name, d in DATATYPES.items() if d.torch is not None
}
FROM_TORCH: dict[torch.dtype, str] = {v: k for k, v in TO_TORCH.items()}


def datatype_of(tensor: Value) -> str:
    """The protocol name of a tensor's dtype (BYTES for strings), or a readable error for dtypes the
    protocol cannot carry."""
    if not isinstance(tensor, torch.Tensor):
        return "BYTES"
    try:
        return FROM_TORCH[tensor.dtype]
    except KeyError:
        raise TypeError(f"dtype {tensor.dtype} cannot be returned through the inference protocol") from None
