"""Protocol datatype names <-> torch dtypes (worker side only; the daemon never imports torch).

The names and dtypes come from the one table, mpsd.ipc.dtypes.DATATYPES.
"""

from __future__ import annotations

import torch

from mpsd.ipc.dtypes import DATATYPES

TO_TORCH: dict[str, torch.dtype] = {name: getattr(torch, d.torch) for name, d in DATATYPES.items()}
FROM_TORCH: dict[torch.dtype, str] = {v: k for k, v in TO_TORCH.items()}


def datatype_of(tensor: torch.Tensor) -> str:
    """The protocol name of a tensor's dtype, or a readable error for dtypes the protocol cannot carry."""
    try:
        return FROM_TORCH[tensor.dtype]
    except KeyError:
        raise TypeError(f"dtype {tensor.dtype} cannot be returned through the inference protocol") from None
