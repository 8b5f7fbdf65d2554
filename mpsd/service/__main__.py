"""`python -m mpsd.service COMMAND ...` behaves like `mpsd service COMMAND ...` (see mpsd.cli.service).

It builds only the service commands' parser, so they can be run (and tested) without the other commands.
"""

from __future__ import annotations

import sys

from mpsd.cli.service import main

if __name__ == "__main__":
    sys.exit(main())
