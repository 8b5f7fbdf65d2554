"""The benchmarks' process helpers (bench/common.py): a benchmark stopped with SIGTERM stops what it
started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


SIGTERMED = """
import signal, sys, threading
from pathlib import Path
from bench import common
common.exit_on_sigterm()
try:
    # to this thread: its handler runs before the next line, or the default action ends the process here
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
    sys.exit("SIGTERM did not end the benchmark")
finally:
    Path(sys.argv[1]).write_text("stopped")
"""


def test_a_benchmark_sent_sigterm_runs_its_finally_blocks(tmp_path: Path) -> None:
    """What stops the servers a benchmark started (each in a session of its own) is its `finally`: SIGTERM
    must reach it, as Ctrl-C does, instead of killing the benchmark outright."""
    marker = tmp_path / "finally"
    done = subprocess.run([sys.executable, "-c", SIGTERMED, str(marker)], cwd=ROOT, timeout=60)
    assert done.returncode == 128 + 15
    assert marker.read_text() == "stopped"
