"""Registers `doctor` on the `mpsd` command line."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

# The checks' names, in the order they run (mpsd.tools.doctor.NAMES, which imports torch's neighbours: the
# parser is built without them).
CHECKS = (
    "python",
    "torch",
    "device",
    "worker",
    "shared_memory",
    "socket_paths",
    "open_files",
    "config",
    "ports",
    "repository",
    "service",
    "privacy_folders",
)


def _doctor(args: argparse.Namespace) -> int:
    from mpsd.cli.serve import check_servable
    from mpsd.tools.doctor import run

    return run(args.config, args.json, check_servable, args.only or (), getattr(args, "debug", False))


def add_doctor_parser(sub: Any) -> None:
    doctor = sub.add_parser(
        "doctor",
        help="check that this machine can serve: Python, torch, the device, a real worker, shared memory, "
        "socket paths, open files, ports, the repository, the service, privacy-protected folders",
        description="One line per check, each with a fix when it fails; run it first on a new machine and "
        "paste its output (or --json) into bug reports. Exit status: 0 when every check passes, 1 otherwise.",
        epilog="examples:\n  mpsd doctor\n  mpsd doctor --config /etc/mpsd/mpsd.yaml --json",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    doctor.add_argument(
        "--config",
        type=Path,
        help="daemon config whose ports and repository are checked (default: as `mpsd "
        "serve`, config/mpsd.yaml if present)",
    )
    doctor.add_argument(
        "--json", action="store_true", help="the checks as a JSON list of {check, ok, detail, fix}"
    )
    doctor.add_argument(
        "--only",
        action="append",
        choices=CHECKS,
        metavar="CHECK",
        help=f"run only this check (repeatable): {', '.join(CHECKS)}",
    )
    doctor.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    doctor.set_defaults(func=_doctor)
