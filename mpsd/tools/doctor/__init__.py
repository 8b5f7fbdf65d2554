"""`mpsd doctor`: whether this machine can serve, one line per check, each with a fix when it fails.

The first command a new user runs, and what a bug report carries. Each check uses the daemon's own code
(placement and the worker's device probes, a real worker process, shared-memory regions, the socket
directory, the port check, `mpsd validate`'s checks, the service managers), so a check that passes here
passes in the daemon. Limits are read from `osfacts.current()`, which tests set to macOS's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from mpsd import osfacts
from mpsd.config.daemon_config import DaemonConfig
from mpsd.tools.doctor import runtime, setup, system, worker
from mpsd.tools.doctor.report import Check, Setup, as_json, guarded, line

Servable = Callable[[DaemonConfig], None]  # `mpsd serve`'s own check of a config, which the CLI owns


def _checks(found: Setup, check_servable: Servable) -> list[tuple[str, Callable[[], Check]]]:
    return [
        ("python", runtime.python_version),
        ("torch", runtime.torch_build),
        ("device", runtime.auto_device),
        ("worker", worker.worker_answers),
        ("shared_memory", system.shared_memory),
        ("socket_paths", lambda: system.socket_paths(found)),
        ("open_files", lambda: system.open_files(found)),
        ("config", lambda: setup.config(found, check_servable)),
        ("ports", lambda: setup.ports(found)),
        ("repository", lambda: setup.repository(found)),
        ("service", setup.service),
        ("privacy_folders", lambda: setup.privacy(found)),
    ]


NAMES = tuple(name for name, _ in _checks(Setup(None, None), lambda _: None))


def run(
    config: Path | None,
    json_output: bool,
    check_servable: Servable,
    only: Sequence[str] = (),
    debug: bool = False,
) -> int:
    """Run every check (or those named in `only`, in their usual order), printing each line as it is found
    (or, with `json_output`, the list at the end); exit status 1 when any check failed."""
    found = setup.read_setup(config)
    checks = [(n, c) for n, c in _checks(found, check_servable) if not only or n in only]
    if not json_output:
        print(f"mpsd doctor: {osfacts.current().name} facts, python {sys.executable}", flush=True)
    results = []
    for name, check in checks:
        result = guarded(name, check, debug)
        results.append(result)
        if not json_output:
            print(line(result), flush=True)
    if json_output:
        print(as_json(results))
    return 0 if all(r.ok for r in results) else 1
