"""What the stand-in launchctl and systemctl share when they run the job's own command line (FAKE_EXEC):
starting it as launchd or systemd would, in a session of its own, and stopping it with SIGTERM. The snippet
is pasted into each stand-in script, which keeps the pid in its state directory."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path

PROCESS_CONTROL = """
import signal, subprocess, time

def start_process(argv, cwd, env, out_path, err_path):
    with open(out_path, "ab") as out, open(err_path, "ab") as err:
        proc = subprocess.Popen(argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                start_new_session=True)
    (state / "pid").write_text(str(proc.pid))

def stop_process():
    pid_file = state / "pid"
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    pid_file.unlink()
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    for _ in range(600):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
"""


def kill_started(state: Path) -> None:
    """A daemon a stand-in started and no test stopped: its whole session goes."""
    pid_file = state / "pid"
    if pid_file.exists():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(int(pid_file.read_text()), signal.SIGKILL)
