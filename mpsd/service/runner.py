"""Run command lines and write files, or, in dry-run mode, only print what would happen.

Backends never call subprocess or write files directly, so `--dry-run` is exact by construction: what it
prints is the sequence the real run would execute.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from mpsd.service.errors import ServiceError


@dataclass(frozen=True)
class Result:
    """Exit status and captured output of one command."""

    argv: tuple[str, ...]
    returncode: int
    stdout: str = ""
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def output(self) -> str:
        """stderr and stdout together: launchctl prints some errors on one, some on the other."""
        return "\n".join(part.strip() for part in (self.stderr, self.stdout) if part.strip())


class Runner:
    """Executes (or, with dry_run, prints) commands and file changes for the service backends."""

    def __init__(self, *, dry_run: bool = False, out: TextIO | None = None, echo: TextIO | None = None):
        self.dry_run = dry_run
        self._out = out if out is not None else sys.stdout
        self._echo = echo if echo is not None else sys.stderr

    def run(self, argv: Sequence[str], *, capture: bool = True) -> Result:
        """Run a command that changes something; echoed as `+ cmd` so the user sees what was done."""
        if self.dry_run:
            print(f"$ {shlex.join(argv)}", file=self._out)
            return Result(tuple(argv), 0)
        print(f"+ {shlex.join(argv)}", file=self._echo, flush=True)
        return self._execute(argv, capture=capture)

    def probe(self, argv: Sequence[str], *, assume: Result | None = None) -> Result:
        """Run a read-only query; in dry-run print it and return `assume` (default: success)."""
        if self.dry_run:
            fake = assume if assume is not None else Result(tuple(argv), 0)
            outcome = "succeeds" if fake.ok else "fails"
            print(f"# query: {shlex.join(argv)}  (dry run assumes it {outcome})", file=self._out)
            return fake
        return self._execute(argv, capture=True)

    def interactive(self, argv: Sequence[str]) -> int:
        """Run with the terminal attached (log viewers); Ctrl-C ends it quietly."""
        if self.dry_run:
            print(f"$ {shlex.join(argv)}", file=self._out)
            return 0
        try:
            return self._execute(argv, capture=False).returncode
        except KeyboardInterrupt:
            return 130

    def write_file(self, path: Path, content: bytes, *, mode: int = 0o644) -> None:
        """Write atomically (temp file + rename) so launchd/systemd never read a half-written file."""
        if self.dry_run:
            print(f"# write {path} (mode {mode:o}):", file=self._out)
            print(content.decode("utf-8").rstrip("\n"), file=self._out)
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(content)
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        print(f"+ wrote {path}", file=self._echo, flush=True)

    def make_dir(self, path: Path, *, mode: int = 0o755) -> None:
        if self.dry_run:
            print(f"$ mkdir -p {shlex.quote(str(path))}", file=self._out)
            return
        path.mkdir(parents=True, exist_ok=True, mode=mode)

    def remove_file(self, path: Path) -> bool:
        """Remove if present; returns whether there was something to remove."""
        if self.dry_run:
            print(f"$ rm -f {shlex.quote(str(path))}", file=self._out)
            return path.exists()
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        print(f"+ removed {path}", file=self._echo, flush=True)
        return True

    def note(self, text: str) -> None:
        """A comment in dry-run output (what would happen next that is not a command)."""
        if self.dry_run:
            print(f"# {text}", file=self._out)

    def check(self, result: Result, *, hint: str | None = None) -> Result:
        """Turn a failed command into a one-line ServiceError naming the command and its message."""
        if result.ok:
            return result
        first = result.output.splitlines()[0] if result.output else "no output"
        raise ServiceError(
            f"`{shlex.join(result.argv)}` failed (exit {result.returncode}): {first}", hint=hint
        )

    @staticmethod
    def _execute(argv: Sequence[str], *, capture: bool) -> Result:
        try:
            proc = subprocess.run(list(argv), capture_output=capture, text=True, check=False)
        except FileNotFoundError:
            raise ServiceError(
                f"{argv[0]} not found on PATH",
                hint="is this the right service manager for this machine? see --manager",
            ) from None
        return Result(tuple(argv), proc.returncode, proc.stdout or "", proc.stderr or "")
