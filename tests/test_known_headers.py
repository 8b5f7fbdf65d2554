"""A ModelInfer header that passed its checks stands for the next requests with the same bytes: they skip
protobuf parsing and the checks, and still get their own tensor bytes, their own answers, and every error
the full path would give (`mpsd.daemon.api.grpc.known_headers`).

The servicer and the operations are the daemon's own; the registry and the model version under them are
stand-ins that answer at once (the whole path through a running daemon is in every other inference test).
Each scenario runs in a fresh interpreter: see tests/known_headers_scenarios.py.
"""

from __future__ import annotations

import pytest

from tests.fresh_interpreter import run_scenario


@pytest.mark.parametrize("scenario", ["skips", "full-path", "sizes", "property", "submitted"])
def test_known_headers(scenario: str) -> None:
    run_scenario("known_headers_scenarios", scenario)
