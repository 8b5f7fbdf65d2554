"""Where a model's op libraries are (`op_libraries` in its config).

A library is code the worker runs, as a pickle is: each path must resolve, symlinks followed, to inside the
model's folder or to a directory the daemon config lists in `op_library_dirs`. A relative path is looked up
in the version folder first, then in the model folder, so one config serves versions that ship their own
build of a library and versions that share one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from mpsd.errors import Issue


def _candidates(model_dir: Path, version: int, entry: str) -> list[Path]:
    path = Path(entry)
    if path.is_absolute():
        return [path]
    return [model_dir / str(version) / path, model_dir / path]


def _kind_problem(target: Path) -> str | None:
    """A shared object or Python file, or a Python package (a folder with __init__.py)."""
    if target.is_file():
        return None
    if target.is_dir():
        return None if (target / "__init__.py").is_file() else "is a folder without __init__.py"
    return "is not a file"


def _allowed(target: Path, model_dir: Path, allowed_dirs: Sequence[Path]) -> bool:
    roots = [model_dir.resolve(), *(d.resolve() for d in allowed_dirs)]
    return any(target.is_relative_to(root) for root in roots)


def resolve_op_libraries(
    model_dir: Path, version: int, entries: Sequence[str], allowed_dirs: Sequence[Path], config_file: Path
) -> tuple[tuple[str, ...], Issue | None]:
    """The libraries of one version as resolved absolute paths, in config order; or the first problem, as
    an Issue naming `op_libraries.<i>` in `config_file`."""
    resolved: list[str] = []
    for i, entry in enumerate(entries):
        loc: tuple[str | int, ...] = ("op_libraries", i)
        if "\0" in entry:
            return (), Issue(str(config_file), loc, "a path cannot contain NUL")
        found = next((c for c in _candidates(model_dir, version, entry) if c.exists()), None)
        if found is None:
            where = "" if Path(entry).is_absolute() else f" in version folder {version} or the model folder"
            return (), Issue(str(config_file), loc, f"'{entry}' not found{where}")
        try:
            target = found.resolve(strict=True)
        except (OSError, RuntimeError) as exc:  # a symlink loop
            return (), Issue(str(config_file), loc, f"cannot resolve '{entry}': {exc}")
        if not _allowed(target, model_dir, allowed_dirs):
            return (), Issue(
                str(config_file),
                loc,
                f"'{entry}' resolves to {target}, outside the model's folder: an op library is code the "
                "worker runs; keep it in the model's folder, or list its directory in op_library_dirs in "
                "the daemon config",
            )
        problem = _kind_problem(target)
        if problem is not None:
            return (), Issue(str(config_file), loc, f"'{entry}' {problem}")
        resolved.append(str(target))
    return tuple(resolved), None


def libraries_fingerprint(paths: Sequence[str]) -> str:
    """Changes when a library is replaced, resized or rewritten: its workers must load the new one."""
    digest = hashlib.sha256()
    for path in paths:
        target = Path(path)
        files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
        for f in files:
            try:
                st = f.stat()
            except OSError:
                continue
            digest.update(f"{f}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()
