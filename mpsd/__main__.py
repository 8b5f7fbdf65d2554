"""`python -m mpsd` is the same as the `mpsd` console script."""

from mpsd.cli import main

raise SystemExit(main())
