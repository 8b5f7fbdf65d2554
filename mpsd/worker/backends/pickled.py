"""Model files that need Python's pickle, which can run any code while loading: refused by default.

- `torch.save(module)` files under `backend: torchscript` are loaded with `torch.load(weights_only=False)`
  only when the model's config says `allow_pickle: true`; otherwise the load fails with the reason.
- `torch.export.load` falls back to full unpickling for some weights and constants; unless the model
  allows pickle, it runs with `torch.load` forced to `weights_only=True` and `pickle.loads` refused.

TorchScript archives (`torch.jit.save`) are read by TorchScript's own restricted unpickler.
"""

from __future__ import annotations

import contextlib
import pickle
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends.base import map_outputs
from mpsd.worker.strings import Value

HOW_TO_ALLOW = (
    "loading it unpickles arbitrary Python objects, which can run any code; if you trust the file, set "
    "allow_pickle: true in the model's config.yaml, or better, save the model with torch.jit.save or "
    "torch.export.save"
)


class PickleRefused(ValueError):
    """A model file needs full unpickling and the model's config does not allow it."""


def archive_kind(path: str) -> str:
    """'torchscript', 'torch.save' (zip written by torch.save), 'pickle' (legacy torch.save) or 'unknown'."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile:
        with open(path, "rb") as f:
            head = f.read(2)
        return "pickle" if head[:1] == b"\x80" else "unknown"
    if any(n.endswith("/constants.pkl") or n == "constants.pkl" for n in names):
        return "torchscript"
    if any(n.endswith("/data.pkl") or n == "data.pkl" for n in names):
        return "torch.save"
    return "unknown"


class TorchSaveBackend:
    """A whole module written by `torch.save(module)`; only with `allow_pickle: true`."""

    def __init__(self, spec: ModelSpec, device: torch.device) -> None:
        self._names = [o.name for o in spec.outputs]
        loaded = torch.load(spec.model_path, map_location=device, weights_only=False)
        if not isinstance(loaded, torch.nn.Module):
            raise ValueError(
                f"{spec.model_path} holds a {type(loaded).__name__}, not a module (a state_dict needs the "
                "model's code: use backend: python, or save the model with torch.jit.save)"
            )
        self._module = loaded.eval()

    def __call__(self, inputs: Sequence[Value]) -> dict[str, Value]:
        return map_outputs(self._module(*inputs), self._names)


def check_torchscript_file(spec: ModelSpec) -> str:
    """The file's kind; raises PickleRefused for a pickle the config does not allow."""
    kind = archive_kind(spec.model_path)
    if kind in ("torch.save", "pickle") and not spec.allow_pickle:
        raise PickleRefused(
            f"{Path(spec.model_path).name} was written by torch.save, not torch.jit.save: {HOW_TO_ALLOW}"
        )
    if kind == "unknown":
        raise ValueError(f"{spec.model_path} is not a TorchScript archive (written by torch.jit.save)")
    return kind


@contextlib.contextmanager
def no_unpickling(path: str) -> Iterator[None]:
    """While loading one file: `torch.load` only with weights_only=True, `pickle.loads` refused.

    Patches module attributes for the duration of a load on the worker's main thread, before the model
    serves anything; nothing else unpickles in the worker at that time.
    """
    real_load = torch.load
    real_loads = pickle.loads

    def weights_only_load(*args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        try:
            return real_load(*args, **kwargs)
        except pickle.UnpicklingError:
            raise PickleRefused(
                f"{Path(path).name} holds objects that torch.load(weights_only=True) refuses: {HOW_TO_ALLOW}"
            ) from None

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise PickleRefused(f"{Path(path).name} holds a pickled object: {HOW_TO_ALLOW}")

    torch.load = weights_only_load
    pickle.loads = refuse
    try:
        yield
    finally:
        torch.load = real_load
        pickle.loads = real_loads
