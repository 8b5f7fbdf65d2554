"""A peer server's own virtual environment (MLServer, Triton): made and filled with pinned packages by the
bench the first time it is needed, so that neither `make install` nor `make test` ever pulls them in, and
their dependencies never meet mpsd's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

STAMP = "mpsd-bench-installed"


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure(
    venv: Path, packages: list[str], check: str, expected: str, label: str, skip_flag: str
) -> Path | None:
    """The Python of `venv` with `packages` installed, installing them there the first time; None (with a
    message saying why) where they cannot be installed, e.g. with no package index. `check` is Python code
    run there whose output must be `expected` (the version of the package that matters)."""
    python = venv_python(venv)
    stamp = venv / STAMP
    wanted = " ".join(packages)
    if stamp.exists() and stamp.read_text().strip() == wanted and python.exists():
        return python
    print(f"installing {wanted} into {venv} (once; about a minute)", flush=True)
    try:
        if not python.exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "--retries", "1", "--timeout", "20", *packages], check=True, timeout=900)
        version = subprocess.run([str(python), "-c", check], check=True, capture_output=True, text=True)
        if version.stdout.strip() != expected:
            raise RuntimeError(f"installed {version.stdout.strip()}, not {expected}")
    except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
        print(
            f"{label} skipped: could not install {wanted} into {venv} ({exc}). "
            "It needs a package index (network); the other sides run as usual. "
            f"{skip_flag} skips the attempt.",
            flush=True,
        )
        return None
    stamp.write_text(wanted + "\n")
    return python
