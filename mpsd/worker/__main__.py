"""Entry point of a worker process."""

from mpsd.worker.main import main

raise SystemExit(main())
