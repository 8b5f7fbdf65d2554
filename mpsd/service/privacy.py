"""Paths a launchd job cannot open: those under macOS's privacy-protected (TCC) folders.

A program started from Terminal inherits Terminal's grant to ~/Documents, ~/Desktop, ~/Downloads, iCloud
Drive and /Volumes; a launchd job has none, so exec or open fails with EPERM (or exit 126) and `mpsd
service install` would otherwise wait out its start timeout. `mpsd service install` refuses such paths and
`mpsd doctor` reports them, both through `protected`, which reads the folders from `osfacts.current()`
(none on Linux).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from mpsd import osfacts


@dataclass(frozen=True)
class ProtectedPath:
    """One path a launchd job could not open, and the protected folder it lies in."""

    what: str  # "config", "venv python", ...
    path: Path
    folder: Path


def protected_folders(home: Path | None = None) -> tuple[Path, ...]:
    """The privacy-protected folders of this system (the user's own and the absolute ones)."""
    facts = osfacts.current()
    home = home if home is not None else Path.home()
    return tuple(home / name for name in facts.tcc_home_folders) + tuple(Path(r) for r in facts.tcc_roots)


def _inside(path: Path, folder: Path) -> bool:
    # APFS is case-insensitive by default: ~/documents is ~/Documents.
    parts, within = [p.casefold() for p in path.parts], [p.casefold() for p in folder.parts]
    return parts[: len(within)] == within


def protected(paths: Iterable[tuple[str, Path]], home: Path | None = None) -> list[ProtectedPath]:
    """Each of `paths` (what, path) that lies in a protected folder, as given or once symlinks are
    resolved (a job follows both)."""
    folders = protected_folders(home)
    found: list[ProtectedPath] = []
    if not folders:
        return found
    for what, path in paths:
        given = Path(os.path.abspath(path))
        for candidate in (given, given.resolve()):
            folder = next((f for f in folders if _inside(candidate, f)), None)
            if folder is not None:
                found.append(ProtectedPath(what, given, folder))
                break
    return found


def checkout() -> Path:
    """Where mpsd's own code is (the checkout, or the environment it is installed in)."""
    return Path(__file__).resolve().parents[2]


def service_paths(
    python: str, config: Path | None, repository: Path | None, working_dir: Path | None = None
) -> list[tuple[str, Path]]:
    """What a service job opens: mpsd's code, the interpreter, the config, the model repository and the
    working directory (the ones known)."""
    paths = [("checkout", checkout()), ("venv python", Path(python))]
    for what, path in (
        ("config", config),
        ("model repository", repository),
        ("working directory", working_dir),
    ):
        if path is not None:
            paths.append((what, path))
    return paths


def hint(found: list[ProtectedPath], python: str) -> str:
    """What to do about them: move them out, or grant the service's interpreter Full Disk Access."""
    folders = sorted({str(p.folder) for p in found})
    real = os.path.realpath(python)
    return (
        f"a launchd job may not open files in {', '.join(folders)} (privacy protection): move the checkout, "
        "its .venv, the config and the model repository elsewhere (e.g. ~/mpsd; recreate the venv there "
        f"with `make install`), or grant Full Disk Access to {real} in System Settings > Privacy & Security "
        "> Full Disk Access (see docs/macos.md)"
    )
