"""ModelInfer responses built from a template per model version and output signature
(`mpsd.daemon.api.grpc.responses.ResponseTemplates`) parse exactly as the message protobuf builds, whatever
the id, and a template stands only for the outputs it was built from. Each scenario runs in a fresh
interpreter: see tests/response_templates_scenarios.py.
"""

from __future__ import annotations

import pytest

from tests.fresh_interpreter import run_scenario


@pytest.mark.parametrize("scenario", ["parses", "keys", "shm", "bounded"])
def test_response_templates(scenario: str) -> None:
    run_scenario("response_templates_scenarios", scenario)
