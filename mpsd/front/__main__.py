"""Entry point of a front process (started by the daemon, never by hand)."""

from mpsd.front.main import main

raise SystemExit(main())
