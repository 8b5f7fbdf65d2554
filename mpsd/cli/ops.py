"""`mpsd status|logs|health|reload|profile`: arguments and exit statuses; the clients are mpsd.tools.ops.

Expected failures (daemon not running, unknown model) are one line on stderr and a distinct exit status,
never a traceback unless `--debug` asks for one.
"""

from __future__ import annotations

import argparse
import functools
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc

from mpsd.cli.connection import add_connection_args
from mpsd.logs.levels import CHOICES
from mpsd.tools import ops
from mpsd.tools.common import EX_UNAVAILABLE

Handler = Callable[[argparse.Namespace], int]


def _guarded(handler: Handler) -> Handler:
    @functools.wraps(handler)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except grpc.RpcError as exc:
            if getattr(args, "debug", False):
                raise
            code, details = exc.code(), exc.details()  # type: ignore[attr-defined]
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                print(f"mpsd: cannot reach the daemon at {args.address}: {details}", file=sys.stderr)
                print(
                    "hint: is it running (`mpsd serve`)? pass --address if it listens elsewhere",
                    file=sys.stderr,
                )
                return EX_UNAVAILABLE
            print(f"mpsd: {code.name}: {details}", file=sys.stderr)
            return 1

    return wrapper


@_guarded
def _status(args: argparse.Namespace) -> int:
    return ops.status(args, args.json, args.timeout)


@_guarded
def _logs(args: argparse.Namespace) -> int:
    return ops.logs(
        args, args.model, args.level, args.kind, args.replay, args.follow, args.json, args.timeout
    )


@_guarded
def _health(args: argparse.Namespace) -> int:
    return ops.health(args, args.model or "", args.timeout)


@_guarded
def _reload(args: argparse.Namespace) -> int:
    return ops.reload(args, args.timeout)


@_guarded
def _profile(args: argparse.Namespace) -> int:
    from mpsd.tools import profile

    window = (args.seconds, args.requests)
    return profile.run(args, args.model, args.version, args.instance, *window, args.out, args.mps_gpu_trace)


# ---- parsers ---------------------------------------------------------------------------------------


def _common(parser: argparse.ArgumentParser, timeout: float) -> None:
    add_connection_args(parser, timeout)


def add_ops_parsers(sub: Any) -> None:
    """Register status, logs, health, reload and profile on the `mpsd` sub-command parser."""
    _add_status(sub)
    _add_logs(sub)
    _add_health(sub)
    _add_reload(sub)
    _add_profile(sub)


def _add_status(sub: Any) -> None:
    status = sub.add_parser(
        "status",
        help="models, versions and workers of a running daemon",
        epilog="example: mpsd status --json",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    _common(status, 10.0)
    status.set_defaults(func=_status)


def _add_logs(sub: Any) -> None:
    logs = sub.add_parser(
        "logs",
        help="events from the daemon and its workers",
        epilog="example: mpsd logs -f --model resnet --level warning",
    )
    logs.add_argument("-f", "--follow", action="store_true", help="keep printing new events until Ctrl-C")
    logs.add_argument("--model", help="only events about this model")
    logs.add_argument(
        "--level", choices=CHOICES, help="lowest level shown (default: info; every level with --kind)"
    )
    logs.add_argument(
        "--kind",
        action="append",
        help="only events of this kind (repeatable): worker, crash, device, memory, load, oom, request, "
        "reload, stdout, stderr, mps_fallback, daemon",
    )
    logs.add_argument("--replay", type=int, default=20, metavar="N", help="past events first (default 20)")
    logs.add_argument("--json", action="store_true", help="one JSON object per line")
    _common(logs, 30.0)
    logs.set_defaults(func=_logs)


def _add_health(sub: Any) -> None:
    health = sub.add_parser(
        "health",
        help="exit 0 when the daemon (or MODEL) is serving",
        description="Standard gRPC health check. Without MODEL: the daemon is live. "
        "`inference.GRPCInferenceService` is server readiness (every model ready). "
        "Exit status: 0 serving, 1 not serving or unknown, 69 daemon unreachable.",
        epilog="example: mpsd health resnet",
    )
    health.add_argument("model", nargs="?", help="a model name (or a gRPC service name)")
    _common(health, 5.0)
    health.set_defaults(func=_health)


def _add_reload(sub: Any) -> None:
    reload = sub.add_parser(
        "reload",
        help="reconcile the daemon with its model repository now",
        epilog="example: mpsd reload --address unix:///run/mpsd/mpsd.sock",
    )
    _common(reload, 600.0)
    reload.set_defaults(func=_reload)


def _add_profile(sub: Any) -> None:
    profile = sub.add_parser(
        "profile",
        help="profile one worker of a model while it serves (a Chrome trace; MPS: Instruments signposts)",
        description=textwrap.fill(
            "The model's worker profiles its executions for the window while it goes on answering "
            "requests; the result comes back here. CUDA and CPU: a torch.profiler Chrome trace (shapes "
            "recorded) saved to --out. MPS: os_signposts for Instruments, and how to record them. Needs a "
            "token with the model-repository category where tokens are configured.",
            width=100,
        ),
        epilog="examples:\n  mpsd profile resnet --requests 200 --out resnet.json\n"
        "  mpsd profile resnet --version 2 --seconds 10",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    profile.add_argument("model")
    profile.add_argument("--version", type=int, default=0, help="model version (default: the latest ready)")
    profile.add_argument("--instance", type=int, default=0, help="which instance of the version (default 0)")
    window = profile.add_mutually_exclusive_group(required=True)
    window.add_argument("--seconds", type=float, metavar="N", help="profile for N seconds (at most 300)")
    window.add_argument(
        "--requests", type=int, metavar="N", help="profile until N requests have run (at most 60 s)"
    )
    profile.add_argument(
        "--out", type=Path, metavar="FILE", help="where the trace goes (default MODEL-profile-TIME.json)"
    )
    profile.add_argument(
        "--mps-gpu-trace",
        action="store_true",
        help="MPS: also a Metal GPU trace (the daemon needs MTL_CAPTURE_ENABLED=1), saved beside --out",
    )
    _common(profile, 10.0)
    profile.set_defaults(func=_profile)
