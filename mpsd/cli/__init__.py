"""The `mpsd` command line. Errors are one readable line plus a hint; `--debug` shows tracebacks.

One module per command group parses its arguments and reports its errors: serve, ops (status, logs, health,
reload, profile), tools (validate, infer, models, init-model), tune, convert (convert-config), doctor and
service. What the commands do lives with the code they drive (mpsd.tools, mpsd.service, mpsd.daemon).
"""

from __future__ import annotations

import argparse
import sys

import mpsd


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpsd",
        description="Serve PyTorch models over Triton's gRPC inference protocol.",
        epilog="example: mpsd serve --model-repository config/models --grpc-address 127.0.0.1:8001",
    )
    parser.add_argument("--version", action="version", version=f"mpsd {mpsd.__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    from mpsd.cli.convert import add_convert_parser
    from mpsd.cli.doctor import add_doctor_parser
    from mpsd.cli.ops import add_ops_parsers
    from mpsd.cli.serve import add_serve_parser
    from mpsd.cli.tools import add_tool_parsers
    from mpsd.cli.tune import add_tune_parser

    add_serve_parser(sub)
    add_ops_parsers(sub)
    add_tool_parsers(sub)
    add_tune_parser(sub)
    add_convert_parser(sub)
    add_doctor_parser(sub)
    try:
        from mpsd.cli.service import add_service_parser
    except ImportError:
        pass
    else:
        add_service_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result: int = args.func(args)
        return result
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if args.debug:
            raise
        print(f"mpsd: {exc}", file=sys.stderr)
        print("hint: run again with --debug for the full traceback", file=sys.stderr)
        return 1
