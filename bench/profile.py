"""Sampling profiles (py-spy) of the daemon and a worker while a load runs: where the CPU time goes."""

from __future__ import annotations

import collections
import json
import linecache
import shutil
import subprocess
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EXTRA = ["--nonblocking"]
RATE = 250


def worker_pid(log_path: Path, model: str) -> int:
    """The pid of the model's (first) worker, from the daemon's JSON log line 'worker ready'."""
    pid = 0
    for line in log_path.read_text(errors="replace").splitlines():
        if '"worker ready"' not in line:
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        if str(event.get("worker", "")).startswith(f"{model}/"):
            pid = int(event["pid"])
    if not pid:
        raise RuntimeError(f"no 'worker ready' line for model {model} in {log_path}")
    return pid


def py_spy() -> str | None:
    candidate = Path(sys.executable).with_name("py-spy")
    return str(candidate) if candidate.exists() else shutil.which("py-spy")


class PySpy:
    """`py-spy record --format raw` on each named process for `duration_s`; on-CPU samples only, taken
    without pausing the process (--nonblocking), at `rate` Hz (250 by default; a few seconds of a busy
    daemon then give a few hundred samples, too few to rank steps of 1-2% each). Raw profiles go to
    `<stem>-<name>.txt`."""

    def __init__(self, stem: Path, pids: dict[str, int], duration_s: float, rate: int = RATE) -> None:
        self.paths = {name: stem.parent / f"{stem.name}-{name}.txt" for name in pids}
        self.pids = pids
        self.duration_s = duration_s
        self.rate = rate
        self._procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> PySpy:
        exe = py_spy()
        if exe is None:
            print("py-spy not found: no profile taken")
            return self
        for name, pid in self.pids.items():
            cmd = [exe, "record", "--format", "raw", "--rate", str(self.rate), *EXTRA]
            cmd += ["--duration", str(int(self.duration_s + 0.999)), "-o", str(self.paths[name])]
            cmd += ["--pid", str(pid)]
            self._procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for proc in self._procs:
            try:
                proc.wait(timeout=self.duration_s + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def summaries(self, top: int = 12) -> dict[str, Any]:
        return {
            name: summarize(path, top) | {"file": path.name}
            for name, path in self.paths.items()
            if path.exists() and path.stat().st_size > 0  # empty: py-spy could not sample that process
        }


IDLE_CALLS = ("select(", "sleep(", ".wait(", "poll(", "recv_into(")


def _idle(frame: str) -> bool:
    """A leaf frame whose source line waits (select, sleep, wait): the thread is blocked, not busy."""
    func, _, where = frame.partition(" (")
    path, _, line = where.rstrip(")").rpartition(":")
    if not line.isdigit():
        return False
    if func.endswith("select") and path.endswith("selectors.py"):
        return True
    for base in (Path(path), ROOT / path):
        if base.is_file():
            source = linecache.getline(str(base), int(line))
            return any(call in source for call in IDLE_CALLS)
    return False


def summarize(path: Path, top: int = 12) -> dict[str, Any]:
    """The main thread's samples: the share that was busy, and the functions busy samples fell in
    (own time, and including callees), as percentages of the busy samples."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = busy = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not frames[0].startswith(("_run_module_as_main", "<module>")):
            continue  # another thread: heartbeats, watchers, child waiters
        n = int(count)
        total += n
        if _idle(frames[-1]):
            continue
        busy += n
        own[_function(frames[-1])] += n
        for frame in {_function(f) for f in frames}:
            inclusive[frame] += n

    def pct(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(f, round(100.0 * n / busy, 1)) for f, n in counter.most_common(top)] if busy else []

    return {
        "main_thread_samples": total,
        "busy_share": round(busy / total, 3) if total else 0.0,
        "own": pct(own),
        "inclusive": pct(inclusive),
    }


def _function(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`, keeping the package path for mpsd files."""
    if " (" not in frame:
        return frame
    func, _, where = frame.partition(" (")
    where = where.rstrip(")").rpartition(":")[0] or where
    where = "mpsd/" + where.split("mpsd/", 1)[1] if "mpsd/" in where else where.rsplit("/", 1)[-1]
    return f"{func} ({where})"
