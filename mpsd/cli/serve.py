"""`mpsd serve`: the daemon in the foreground. A configuration it cannot serve stops it before anything
starts, with one line and exit status 78 (EX_CONFIG), or, with `--on-config-error wait`, holds it until the
file is fixed."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mpsd.errors import ConfigError
from mpsd.logs.levels import CHOICES

if TYPE_CHECKING:
    from mpsd.config.daemon_config import DaemonConfig

EX_CONFIG = 78
STARTING = "mpsd: configuration accepted; starting"
DEFAULT_CONFIG = Path("config/mpsd.yaml")


def check_servable(config: DaemonConfig, event_loop: bool = True) -> None:
    """What `mpsd serve` checks before anything starts, beyond the file itself (`mpsd service install`
    checks the same, but the event loop, which is the service's interpreter's to have): ConfigError for a
    setting the daemon cannot serve."""
    from mpsd.daemon.supervise.fronts.policy import front_plan
    from mpsd.net import eventloop

    front_plan(config)  # fronts the addresses cannot serve are a configuration error
    from mpsd.net.listen import http_address, openai_address, parse_address, same_port

    grpc = parse_address(config.grpc_address)
    http = http_address(config.http_address)
    if http is not None and same_port(http, grpc):
        raise ConfigError(f"http_address {http.text} and grpc_address {config.grpc_address} collide")
    openai = openai_address(config.openai_address)
    for setting, other in (("grpc_address", grpc), ("http_address", http)):
        if openai is not None and other is not None and same_port(openai, other):
            raise ConfigError(f"openai_address {openai.text} and {setting} {other.text} collide")
    if event_loop:
        eventloop.check(config.event_loop)
    if not config.model_repository.is_dir():
        raise ConfigError(f"model repository {config.model_repository} is not a directory")
    uploads = config.model_upload_dir
    if uploads is not None:
        if not uploads.is_dir():
            raise ConfigError(f"model_upload_dir {uploads} is not a directory")
        if uploads.resolve().is_relative_to(config.model_repository.resolve()):
            raise ConfigError(f"model_upload_dir {uploads} is inside the model repository; keep it outside")


def _load(args: argparse.Namespace, config_path: Path | None) -> DaemonConfig:
    """The config file with the command line's overrides, checked: ConfigError if it cannot be served."""
    from mpsd.config.daemon_config import load_daemon_config

    config = load_daemon_config(config_path)
    if args.model_repository is not None:
        config.model_repository = args.model_repository.resolve()
    if args.grpc_address is not None:
        config.grpc_address = args.grpc_address
    if args.http_address is not None:
        config.http_address = args.http_address
    if args.metrics_address is not None:
        config.metrics_address = args.metrics_address
    if args.log_level is not None:
        config.log_level = args.log_level
    if args.front_processes is not None:
        config.front_processes = args.front_processes
    if args.shutdown_grace is not None:
        config.shutdown_grace_s = args.shutdown_grace
    check_servable(config)
    return config


def _stamp(path: Path | None) -> tuple[float, int] | None:
    try:
        stat = path.stat() if path is not None else None
    except OSError:
        return None
    return (stat.st_mtime, stat.st_size) if stat is not None else None


def wait_for_valid_config(
    args: argparse.Namespace, config_path: Path | None, error: ConfigError, recheck_s: float = 30.0
) -> DaemonConfig:
    """`--on-config-error wait`, for launchd, which restarts a job whatever its exit status: say what is
    wrong once, then check again whenever the config file changes (and every `recheck_s`, for a model
    repository that appears) until it can be served. `mpsd service status` reports the error meanwhile."""
    print(f"mpsd: configuration error: {error.message}", file=sys.stderr)
    what = config_path if config_path is not None else "the command line's settings"
    print(f"mpsd: waiting for a fix of {what} (checked again when it changes)", file=sys.stderr, flush=True)
    last, checked = _stamp(config_path), time.monotonic()
    while True:
        time.sleep(0.5)
        stamp = _stamp(config_path)
        if stamp == last and time.monotonic() - checked < recheck_s:
            continue
        last, checked = stamp, time.monotonic()
        try:
            config = _load(args, config_path)
        except ConfigError as exc:
            if exc.message != error.message:
                error = exc
                print(f"mpsd: configuration error: {exc.message}", file=sys.stderr, flush=True)
            continue
        print("mpsd: configuration fixed; starting", file=sys.stderr, flush=True)
        return config


def _serve(args: argparse.Namespace) -> int:
    from mpsd.logs import configure

    config_path: Path | None = args.config
    if config_path is None and DEFAULT_CONFIG.is_file():
        config_path = DEFAULT_CONFIG
    try:
        config = _load(args, config_path)
    except ConfigError as exc:
        if args.on_config_error != "wait":
            print(f"mpsd: configuration error: {exc.message}", file=sys.stderr)
            return EX_CONFIG
        config = wait_for_valid_config(args, config_path, exc)
    else:
        if args.on_config_error == "wait":  # a line of this run: an error an earlier run logged is past
            print(STARTING, file=sys.stderr, flush=True)
    configure(config.log_level, config.log_format)
    from mpsd.daemon.main import serve
    from mpsd.daemon.shutdown import EXIT_FORCED

    try:
        return serve(config, config_path)
    except ConfigError as exc:  # found as the daemon starts: an address it cannot listen on, a TLS file
        print(f"mpsd: configuration error: {exc.message}", file=sys.stderr, flush=True)
        return EX_CONFIG
    except Exception as exc:  # the daemon failed (its fronts did not start, say): ended, its ports closed
        if args.debug:
            raise
        print(f"mpsd: the daemon failed: {exc}", file=sys.stderr)
        print("hint: run again with --debug for the full traceback", file=sys.stderr, flush=True)
        return EXIT_FORCED


def add_serve_parser(subparsers: Any) -> None:
    serve = subparsers.add_parser(
        "serve",
        help="run the daemon in the foreground",
        epilog="example: mpsd serve --config config/mpsd.yaml",
    )
    serve.add_argument(
        "--config", type=Path, help=f"daemon config file (default: {DEFAULT_CONFIG} if present)"
    )
    serve.add_argument("--model-repository", type=Path, help="directory with one folder per model")
    serve.add_argument("--grpc-address", help="host:port to listen on (default 127.0.0.1:8001)")
    serve.add_argument(
        "--http-address",
        help="host:port of the KServe v2 HTTP/REST protocol (default 127.0.0.1:8000), or unix:///path; "
        '"" or "off" disables it',
    )
    serve.add_argument(
        "--metrics-address",
        help='host:port of the Prometheus endpoint (default 127.0.0.1:8002); "" or "off" disables it',
    )
    serve.add_argument("--log-level", choices=CHOICES)
    serve.add_argument(
        "--front-processes",
        type=lambda v: v if v == "auto" else int(v),
        help="gRPC front processes sharing the port (Linux; 0: none; default: the config's, auto)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="SECONDS",
        help="at SIGTERM, seconds health says NOT_SERVING while new calls are still served, before the "
        "drain (default: the config's shutdown_grace_s, 5)",
    )
    serve.add_argument(
        "--on-config-error",
        choices=("exit", "wait"),
        default="exit",
        help="exit with status 78 (default), or report the error and wait for the config file to be fixed "
        "(launchd jobs: launchd restarts a job whatever its exit status)",
    )
    serve.set_defaults(func=_serve)
