"""AOTInductor packages (`model.aoti.pt2` written by `torch._inductor.aoti_compile_and_package`).

A package holds code compiled ahead of time for one device type (and one platform): it is read before it
is loaded, and refused with the reason when it was compiled for another device than the instance's.
"""

from __future__ import annotations

import json
import platform
import zipfile
from collections.abc import Sequence

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends.base import map_outputs
from mpsd.worker.strings import Value

_METADATA_SUFFIX = "_metadata.json"


class PackageMismatch(ValueError):
    """The package was compiled for another device type or platform than the instance runs on."""


def package_metadata(path: str) -> dict[str, str]:
    """AOTInductor's metadata of the package's compiled model (AOTI_DEVICE_KEY, AOTI_PLATFORM, ...), read
    from the archive without loading any code."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [
                n for n in archive.namelist() if "/data/aotinductor/" in n and n.endswith(_METADATA_SUFFIX)
            ]
            if not names:
                raise ValueError(
                    f"{path} holds no AOTInductor model: write it with "
                    "torch._inductor.aoti_compile_and_package (a torch.export.save program is backend "
                    "torch_export)"
                )
            names.sort(key=lambda n: not n.endswith("wrapper" + _METADATA_SUFFIX))
            metadata = json.loads(archive.read(names[0]))
    except zipfile.BadZipFile:
        raise ValueError(f"{path} is not an AOTInductor package (not a zip archive)") from None
    return {str(k): str(v) for k, v in metadata.items()}


def _platform() -> str:
    return platform.system().lower()


def check_package(metadata: dict[str, str], device: torch.device) -> None:
    """PackageMismatch naming both sides when the package cannot run on this device."""
    compiled_for = metadata.get("AOTI_DEVICE_KEY", "")
    if compiled_for and compiled_for != device.type:
        raise PackageMismatch(
            f"the AOTInductor package was compiled for {compiled_for}, but this instance runs on "
            f"{device.type}: compile it for {device.type} (aoti_compile_and_package with the model and its "
            f"example inputs on {device.type}), or set the instance group's kind to match"
        )
    built_on = metadata.get("AOTI_PLATFORM", "")
    if built_on and built_on != _platform():
        raise PackageMismatch(
            f"the AOTInductor package was compiled on {built_on}, but this worker runs on {_platform()}: "
            "compile it on the machine type that serves it"
        )


class AotiBackend:
    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        check_package(package_metadata(spec.model_path), device)
        self._names = [o.name for o in spec.outputs]
        index = device.index if device.index is not None else -1
        # Without the runner's thread synchronization when CUDA graphs record it (aoti_load_package's advice).
        graphs = bool(spec.cuda_graph_batch_sizes) and device.type == "cuda"
        self._model = torch._inductor.aoti_load_package(
            spec.model_path, run_single_threaded=graphs, device_index=index
        )

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        return map_outputs(self._model(*inputs), self._names)
