"""Custom op libraries (`op_libraries` in a model's config), loaded before the model; and the reason a model
fails with when it calls an op that no loaded library registers.

A shared object is loaded with `torch.ops.load_library`, whose static initialisers register its ops
(`TORCH_LIBRARY`); a Python file or package is imported, and registers its ops with `torch.library`. The
daemon has already checked that every path is inside the model's folder or an allowed directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import re
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from mpsd.ipc.protocol import ModelSpec
from mpsd.worker.backends import Backend, load_backend

# How torch says a model calls an op nobody registered: TorchScript at load, torch.export while reading the
# program (logged as a warning by torch.export.load, which then raises a message without the op).
_MISSING_OP = (
    re.compile(r"Unknown builtin op: (\w+::\w+)"),
    re.compile(r"failed to resolve torch\.ops\.(\w+)\.(\w+)"),
)


class OpLibraryError(RuntimeError):
    """A listed library could not be loaded, or the model calls an op no library registers."""


def _import(path: Path, index: int) -> None:
    package = path.is_dir()
    stem = re.sub(r"\W", "_", path.stem if not package else path.name)
    name = f"mpsd_op_library_{index}_{stem}"
    location = path / "__init__.py" if package else path
    spec = importlib.util.spec_from_file_location(
        name, location, submodule_search_locations=[str(path)] if package else None
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: a package's relative imports look it up
    spec.loader.exec_module(module)


def load_op_libraries(paths: Sequence[str]) -> None:
    """Load each library in order; OpLibraryError naming the library when one cannot be loaded."""
    for index, entry in enumerate(paths):
        path = Path(entry)
        try:
            if path.is_dir() or path.suffix == ".py":
                _import(path, index)
            else:
                torch.ops.load_library(entry)  # type: ignore[no-untyped-call]
        except Exception as exc:
            raise OpLibraryError(f"op library {entry}: {type(exc).__name__}: {exc}") from exc


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def missing_op(errors: Sequence[BaseException]) -> str | None:
    """The `namespace::name` of an op the errors (and their causes) say is not registered, or None."""
    for error in errors:
        for exc in _chain(error):
            for pattern in _MISSING_OP:
                found = pattern.search(str(exc))
                if found:
                    return "::".join(found.groups()) if len(found.groups()) > 1 else found.group(1)
    return None


class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.errors: list[BaseException] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[1] is not None:
            self.errors.append(record.exc_info[1])


@contextlib.contextmanager
def _export_load_errors() -> Iterator[list[BaseException]]:
    """The exceptions torch.export.load logs (instead of raising) while it reads a program."""
    logger = logging.getLogger("torch.export")
    recorder = _Recorder()
    logger.addHandler(recorder)
    try:
        yield recorder.errors
    finally:
        logger.removeHandler(recorder)


def load_model(spec: ModelSpec, device: torch.device) -> Backend:
    """The spec's op libraries, then its model; a model that calls an unregistered op fails naming it."""
    load_op_libraries(spec.op_libraries)
    with _export_load_errors() as logged:
        try:
            return load_backend(spec, device)
        except Exception as exc:
            op = missing_op([exc, *logged])
            if op is None:
                raise
            listed = ", ".join(Path(p).name for p in spec.op_libraries) or "none"
            raise OpLibraryError(
                f"the model calls the custom op {op}, which no loaded library registers (op_libraries: "
                f"{listed}); list the shared object or Python module that defines it in op_libraries in "
                "the model's config"
            ) from exc
