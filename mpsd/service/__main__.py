"""`python -m mpsd.service COMMAND ...` behaves like `mpsd service COMMAND ...`.

It needs only the service package, so the service commands can be run (and tested) on their own.
"""

from __future__ import annotations

import argparse
import sys

from mpsd.service.cli import add_service_parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mpsd")
    add_service_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["service", *(sys.argv[1:] if argv is None else argv)])
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
