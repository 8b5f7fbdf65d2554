"""`mpsd serve`: the daemon in the foreground. A configuration it cannot serve stops it before anything
starts, with one line and exit status 78 (EX_CONFIG)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from mpsd.errors import ConfigError
from mpsd.logs.levels import CHOICES

EX_CONFIG = 78
DEFAULT_CONFIG = Path("config/mpsd.yaml")


def _serve(args: argparse.Namespace) -> int:
    from mpsd.config.daemon_config import load_daemon_config
    from mpsd.logs import configure

    config_path: Path | None = args.config
    if config_path is None and DEFAULT_CONFIG.is_file():
        config_path = DEFAULT_CONFIG
    try:
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
        from mpsd.daemon.supervise.fronts.policy import front_count

        front_count(config)  # a setting the address cannot serve is a configuration error
        from mpsd.net.listen import http_address, parse_address, same_port

        http = http_address(config.http_address)
        if http is not None and same_port(http, parse_address(config.grpc_address)):
            raise ConfigError(f"http_address {http.text} and grpc_address {config.grpc_address} collide")
        from mpsd.net import eventloop

        eventloop.check(config.event_loop)
        if not config.model_repository.is_dir():
            raise ConfigError(f"model repository {config.model_repository} is not a directory")
    except ConfigError as exc:
        print(f"mpsd: configuration error: {exc.message}", file=sys.stderr)
        return EX_CONFIG
    configure(config.log_level, config.log_format)
    from mpsd.daemon.main import serve

    return serve(config, config_path)


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
    serve.set_defaults(func=_serve)
