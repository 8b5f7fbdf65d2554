"""Protocol datatype names <-> torch dtypes (worker side only; the daemon never imports torch)."""

from __future__ import annotations

import torch

TO_TORCH: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "UINT8": torch.uint8,
    "INT8": torch.int8,
    "INT16": torch.int16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "FP16": torch.float16,
    "BF16": torch.bfloat16,
    "FP32": torch.float32,
    "FP64": torch.float64,
}
FROM_TORCH: dict[torch.dtype, str] = {v: k for k, v in TO_TORCH.items()}


def datatype_of(tensor: torch.Tensor) -> str:
    """The protocol name of a tensor's dtype, or a readable error for dtypes the protocol cannot carry."""
    try:
        return FROM_TORCH[tensor.dtype]
    except KeyError:
        raise TypeError(f"dtype {tensor.dtype} cannot be returned through the inference protocol") from None
