"""Runs `mpsd serve` with a profile hook that records which mpsd files a request enters.

`python tests/walk_recorder.py OUT_DIR serve ...`: SIGUSR1 starts a recording (OUT_DIR/recording appears
once it has), SIGUSR2 ends it and writes OUT_DIR/walk.json (then removes OUT_DIR/recording). The hook sees
every Python call in every thread of the daemon process; a call into an mpsd file is kept with its caller's
mpsd file and its root: the outermost mpsd function of the stack below the event loop's dispatch (or a
thread's start), which names the task or callback it runs in. What roots are background loops rather than the
request is the test's to say, by name, so the rule does not depend on what happens to run meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

OUT = Path(sys.argv.pop(1))
PACKAGE = str(Path(__file__).resolve().parent.parent / "mpsd") + os.sep
# The frames a task's or a callback's stack starts from: asyncio's Handle._run, a thread's run.
DISPATCH = {("events.py", "_run"), ("threading.py", "run"), ("threading.py", "_bootstrap_inner")}

calls: set[tuple[str, str, str, str]] = (
    set()
)  # (root "file:function", caller file or "", callee file, function)
on = False


def _short(path: str) -> str:
    return path[len(PACKAGE) :]


def _where(frame: FrameType) -> tuple[str, str]:
    """(the nearest mpsd caller's file, the root) of a call whose frame is `frame`."""
    caller = ""
    root = frame
    back = frame.f_back
    while back is not None:
        code = back.f_code
        if (os.path.basename(code.co_filename), code.co_name) in DISPATCH:
            break
        if code.co_filename.startswith(PACKAGE):
            caller = caller or code.co_filename
            root = back
        back = back.f_back
    return _short(caller) if caller else "", f"{_short(root.f_code.co_filename)}:{root.f_code.co_name}"


def hook(frame: FrameType, event: str, arg: Any) -> None:
    if not on or event != "call":
        return
    name = frame.f_code.co_filename
    if name.startswith(PACKAGE):
        caller, root = _where(frame)
        calls.add((root, caller, _short(name), frame.f_code.co_name))


def start(*_: object) -> None:
    global on
    calls.clear()
    on = True
    (OUT / "recording").write_text("")


def stop(*_: object) -> None:
    global on
    on = False
    rows = sorted(calls)
    (OUT / "walk.tmp").write_text(json.dumps(rows))
    (OUT / "walk.tmp").rename(OUT / "walk.json")
    (OUT / "recording").unlink()


signal.signal(signal.SIGUSR1, start)
signal.signal(signal.SIGUSR2, stop)
threading.setprofile(hook)
sys.setprofile(hook)

from mpsd.cli import main  # noqa: E402 - after the hook, so that everything the daemon runs is seen

sys.exit(main(sys.argv[1:]))
