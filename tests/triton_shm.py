"""tritonclient's system shared-memory helpers (`tritonclient.utils.shared_memory`), importable unchanged,
and its CUDA ones (`cuda_shm()`) where cuda-python is installed.

That module finds its C library with `pkg_resources.resource_filename`, which setuptools 81 removed. When
pkg_resources is missing, that one function is provided from importlib.resources; when it is present, its
deprecation warning on import is silenced here rather than failing the suite.
"""

from __future__ import annotations

import importlib.resources
import importlib.util
import sys
import types
import warnings


def _resource_filename(package: str, name: str) -> str:
    return str(importlib.resources.files(package) / name)


if importlib.util.find_spec("pkg_resources") is None:
    _shim = types.ModuleType("pkg_resources")
    _shim.resource_filename = _resource_filename  # type: ignore[attr-defined]
    sys.modules["pkg_resources"] = _shim

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message=".*pkg_resources.*")
    import tritonclient.utils.shared_memory as shm


def cuda_shm() -> types.ModuleType | None:
    """`tritonclient.utils.cuda_shared_memory`, or None where it cannot be imported (it needs cuda-python,
    whose older releases warn on import from the names tritonclient uses)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import tritonclient.utils.cuda_shared_memory as cudashm
    except (ImportError, RuntimeError):
        return None
    return cudashm


__all__ = ["cuda_shm", "shm"]
