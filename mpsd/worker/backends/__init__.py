"""Model backends: how a model file becomes a callable from input tensors to named output tensors."""

from __future__ import annotations

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends.base import Backend, map_outputs

__all__ = ["Backend", "load_backend", "map_outputs"]


def load_backend(spec: ModelSpec, device: torch.device) -> Backend:
    """Load the model file named in the spec with the backend its config names."""
    if spec.backend == "torchscript":
        from mpsd.worker.backends.pickled import TorchSaveBackend, check_torchscript_file
        from mpsd.worker.backends.torchscript import TorchScriptBackend

        if check_torchscript_file(spec) != "torchscript":  # a torch.save pickle the config allows
            return TorchSaveBackend(spec, device)
        return TorchScriptBackend(spec, device)
    if spec.backend == "torch_export":
        from mpsd.worker.backends.pickled import no_unpickling
        from mpsd.worker.backends.torch_export import TorchExportBackend

        if spec.allow_pickle:
            return TorchExportBackend(spec, device)
        with no_unpickling(spec.model_path):
            return TorchExportBackend(spec, device)
    if spec.backend == "aoti":
        from mpsd.worker.backends.aoti import AotiBackend

        return AotiBackend(spec, device)
    if spec.backend == "python":
        from mpsd.worker.backends.python_model import PythonBackend

        return PythonBackend(spec, device)
    raise ValueError(f"unknown backend '{spec.backend}'")
