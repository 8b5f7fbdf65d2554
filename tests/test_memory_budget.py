"""The per-device memory budget is checked by the daemon before any worker of a model starts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests import models
from tests.conftest import RunningDaemon


def two_models(repo: Path, fraction: float) -> None:
    # KIND_AUTO on Linux counts against cuda:0 (and runs on the CPU here, where no GPU exists).
    group = [{"kind": "KIND_AUTO", "count": 1, "memory_fraction": fraction}]
    models.add_sub(repo, "first", instance_group=group)
    models.add_sub(repo, "second", instance_group=group)


@pytest.mark.parametrize("policy", ["refuse", "warn"])
def test_fractions_over_one_device(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon], policy: str
) -> None:
    repo = tmp_path / "repo"
    two_models(repo, 0.6)
    config = tmp_path / "mpsd.yaml"
    config.write_text(yaml.safe_dump({"memory_budget_policy": policy, "metrics_address": ""}))
    daemon = start_daemon(repo, config=config)
    daemon.wait_models_settled()
    rows = {r["name"]: r for r in daemon.client.get_model_repository_index(as_json=True)["models"]}
    if policy == "refuse":
        refused = [r for r in rows.values() if r["state"] == "UNAVAILABLE"]
        assert len(refused) == 1, rows  # the model that would overcommit the device is refused
        reason = refused[0]["reason"]
        assert "memory fractions add up to 1.2" in reason
        assert "first/1" in reason and "second/1" in reason
        assert sum(r["state"] == "READY" for r in rows.values()) == 1
    else:
        assert all(r["state"] == "READY" for r in rows.values()), rows
        assert "memory budget exceeded" in daemon.log()
