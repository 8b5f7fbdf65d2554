"""`mpsd convert-config`: arguments, output and exit status; the conversion is mpsd.tools.convert."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

EX_CONFIG = 78


def _run(args: argparse.Namespace) -> int:
    from mpsd.tools.convert import convert

    try:
        text, warnings = convert(args.path, args.to)
    except ValueError as exc:
        print(f"mpsd: convert-config: {exc}", file=sys.stderr)
        return EX_CONFIG
    for warning in warnings:
        print(f"mpsd: warning: ignored by mpsd: {warning}", file=sys.stderr)
    if args.output is None or str(args.output) == "-":
        sys.stdout.write(text)
    else:
        args.output.write_text(text)
    return 0


def add_convert_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "convert-config",
        help="convert a model's config.pbtxt to config.yaml or back",
        description="Print (or write) the equivalent of a model config in the other format. A model "
        "directory holding both files is refused at load, so remove the old one after converting.",
        epilog="example: mpsd convert-config models/resnet/config.pbtxt --output models/resnet/config.yaml",
    )
    parser.add_argument("path", type=Path, help="config.pbtxt, config.yaml, or a model directory")
    parser.add_argument("--to", choices=["yaml", "pbtxt"], help="target format (default: the other one)")
    parser.add_argument("--output", type=Path, help="file to write (default: standard output)")
    parser.set_defaults(func=_run)
