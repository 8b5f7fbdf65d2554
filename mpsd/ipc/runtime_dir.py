"""Where a daemon keeps the files it needs only while it runs (its private socket directory, the record of
its shared-memory names): short enough for a Unix socket path, and the same place for every daemon of a
user, so the next one finds what a daemon killed with -9 left there."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# Longest base kept: a socket path under it must stay within macOS's 104 bytes.
MAX_BASE = 60


def runtime_dir() -> Path:
    """`$XDG_RUNTIME_DIR`, else the temporary folder (`$TMPDIR`), when short enough; else /tmp."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) if len(base) <= MAX_BASE and os.path.isdir(base) else Path("/tmp")
