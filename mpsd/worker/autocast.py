"""Mixed precision per model (`optimization.autocast`): the forward pass runs under `torch.autocast` for
the instance's device, and floating-point outputs go back to their declared datatypes.

Whether a device supports a dtype is asked of torch itself, once, before the model loads: torch.autocast
disables itself with a warning (or raises) for a combination it does not support, and a model that would
then run in full precision while its config says otherwise is refused with that reason instead.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends import Backend
from mpsd.worker.dtypes import TO_TORCH
from mpsd.worker.strings import Value

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def autocast_problem(device_type: str, dtype: torch.dtype) -> str | None:
    """Why torch cannot autocast to `dtype` on `device_type` here, or None when it can."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            context = torch.autocast(device_type, dtype=dtype)
            with context:
                enabled = torch.is_autocast_enabled(device_type)
                active = torch.get_autocast_dtype(device_type)
    except (RuntimeError, ValueError) as exc:
        return str(exc)
    if enabled and active == dtype:
        return None
    said = " ".join(str(w.message).replace("\n", " ") for w in caught)
    return said or f"torch {torch.__version__} did not enable {dtype} autocast on {device_type}"


def check_autocast(spec: ModelSpec, device: torch.device) -> None:
    """ValueError with torch's reason when the configured autocast cannot run on this device."""
    if spec.autocast is None:
        return
    problem = autocast_problem(device.type, DTYPES[spec.autocast])
    if problem is not None:
        raise ValueError(
            f"optimization.autocast {spec.autocast} is not supported on {device.type} with torch "
            f"{torch.__version__}: {problem}"
        )


class AutocastBackend:
    """Calls a backend under torch.autocast; floating-point outputs are cast to their declared types."""

    def __init__(self, backend: Backend, spec: ModelSpec, device: torch.device) -> None:
        assert spec.autocast is not None
        self.backend = backend
        self._device_type = device.type
        self._dtype = DTYPES[spec.autocast]
        self._declared = {o.name: TO_TORCH[o.datatype] for o in spec.outputs}
        # A CUDA graph must not keep the casts of the weights that autocast caches for one region and frees
        # when it ends (torch.cuda.make_graphed_callables says the same).
        self._cache = not (spec.cuda_graph_batch_sizes and device.type == "cuda")

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        with torch.autocast(self._device_type, dtype=self._dtype, cache_enabled=self._cache):
            outputs = self.backend(inputs)
        for name, tensor in outputs.items():
            declared = self._declared.get(name)
            if (
                declared is not None
                and isinstance(tensor, torch.Tensor)
                and tensor.dtype != declared
                and tensor.is_floating_point()
                and declared.is_floating_point
            ):
                outputs[name] = tensor.to(declared)
        return outputs
