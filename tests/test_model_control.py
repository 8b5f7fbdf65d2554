"""Documented behaviour of model control, SIGHUP and reloads (docs/hot-reload.md, docs/api.md,
docs/devices.md), each checked on a real daemon with the stock client."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml
from tritonclient.utils import InferenceServerException

from tests import models
from tests.conftest import RunningDaemon, wait_for


def write_config(path: Path, **settings: object) -> Path:
    path.write_text(yaml.safe_dump({"metrics_address": "", **settings}))
    return path


def constant(repo: Path, version: int, value: float, group: dict[str, Any] | None = None) -> Path:
    model_dir = repo / "const"
    models.write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
            "instance_group": [group or {"kind": "KIND_CPU", "count": 1}],
        },
    )
    staging = repo / f".staging-{version}"
    models.save_torchscript(models.Constant(value), staging / "model.pt")
    os.rename(staging, model_dir / str(version))
    return model_dir


def served(daemon: RunningDaemon, model: str = "const") -> float:
    inp = grpcclient.InferInput("x", [2], "FP32")
    inp.set_data_from_numpy(np.zeros(2, np.float32))
    return float(daemon.client.infer(model, [inp]).as_numpy("y")[0])


def events(daemon: RunningDaemon, message: str) -> list[dict[str, Any]]:
    found = []
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            if event.get("event") == message:
                found.append(event)
    return found


def test_poll_picks_up_a_new_version(tmp_path: Path, start_daemon: Callable[..., RunningDaemon]) -> None:
    """model_control: poll rescans every poll_interval_s (no file-system events needed)."""
    repo = tmp_path / "repo"
    constant(repo, 1, 1.0)
    config = write_config(
        tmp_path / "mpsd.yaml", model_control="poll", poll_interval_s=0.5, reload_quiet_period_s=0.2
    )
    daemon = start_daemon(repo, config=config)
    daemon.wait_ready()
    assert served(daemon) == 1.0
    (watching,) = events(daemon, "watching repository")
    assert watching["mode"] == "poll"
    constant(repo, 2, 2.0)
    wait_for(lambda: served(daemon) == 2.0, 120, "the new version served after a poll")


def test_model_control_none_refuses_load_and_unload(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    repo = tmp_path / "repo"
    constant(repo, 1, 1.0)
    daemon = start_daemon(repo, config=write_config(tmp_path / "mpsd.yaml", model_control="none"))
    daemon.wait_ready()
    config = json.dumps(
        {
            "platform": "pytorch_libtorch",
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [2]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [2]}],
        }
    )
    model = (repo / "const" / "1" / "model.pt").read_bytes()
    calls: list[Callable[[], object]] = [
        lambda: daemon.client.load_model("const"),
        lambda: daemon.client.unload_model("const"),
        lambda: daemon.client.load_model("const", config=config),
        lambda: daemon.client.load_model("sent", config=config, files={"file:1/model.pt": model}),
    ]
    for call in calls:
        with pytest.raises(InferenceServerException) as info:
            call()
        assert info.value.status() == "StatusCode.FAILED_PRECONDITION"
        assert "model control is 'none'" in info.value.message()
    assert served(daemon) == 1.0  # still loaded, as the repository has it
    assert not daemon.client.is_model_ready("sent")


def test_reload_that_does_not_fit_beside_the_old_version_stops_it_first(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """memory_budget_policy: refuse, and old + new versions over the device: the old one stops first, then
    the new one serves (KIND_AUTO counts against cuda:0 on Linux; it runs on the CPU where no GPU is)."""
    repo = tmp_path / "repo"
    group = {"kind": "KIND_AUTO", "count": 1, "memory_fraction": 0.6}
    constant(repo, 1, 1.0, group)
    config = write_config(tmp_path / "mpsd.yaml", model_control="explicit", memory_budget_policy="refuse")
    daemon = start_daemon(repo, config=config)
    daemon.wait_ready()
    constant(repo, 2, 2.0, group)
    daemon.client.load_model("const")
    assert served(daemon) == 2.0
    (stopped_first,) = [
        e
        for e in events(
            daemon,
            "old and new versions do not fit on the device together: stopping the "
            "old version first; the model is not ready until the new one is",
        )
    ]
    assert stopped_first["model"] == "const"
    assert not events(daemon, "memory budget exceeded")


def test_sighup_rereads_the_runtime_settings(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """log_level, drain_timeout_s, memory_budget_policy and reload_quiet_period_s take effect at SIGHUP."""
    repo = tmp_path / "repo"
    group = [{"kind": "KIND_AUTO", "count": 1, "memory_fraction": 0.6}]
    models.add_sub(repo, "first", instance_group=group)
    models.add_sub(repo, "second", instance_group=group)
    path = tmp_path / "mpsd.yaml"
    before = {
        "model_control": "explicit",
        "log_level": "info",
        "drain_timeout_s": 30.0,
        "memory_budget_policy": "refuse",
        "reload_quiet_period_s": 0.0,
    }
    daemon = start_daemon(repo, config=write_config(path, **before))
    daemon.wait_models_settled()
    states = {r["name"]: r["state"] for r in daemon.client.get_model_repository_index(as_json=True)["models"]}
    (refused,) = [name for name, state in states.items() if state == "UNAVAILABLE"]  # 1.2 of one device
    assert daemon.client.get_log_settings(as_json=True)["settings"]["log_verbose_level"]["uint32_param"] == 0

    after = {
        **before,
        "log_level": "debug",
        "drain_timeout_s": 7.0,
        "memory_budget_policy": "warn",
        "reload_quiet_period_s": 60.0,
    }
    write_config(path, **after)
    (repo / refused / "config.yaml").touch()  # changed just now: inside the new quiet period
    daemon.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: events(daemon, "model files still changing: load deferred"), 60, "a deferral")
    assert events(daemon, "model files still changing: load deferred")[0]["quiet_period_s"] == 60.0
    assert daemon.client.get_log_settings(as_json=True)["settings"]["log_verbose_level"]["uint32_param"] >= 1
    daemon.client.load_model(refused)  # refused under 'refuse'; under 'warn' it loads with a warning
    assert daemon.client.is_model_ready(refused)
    assert events(daemon, "memory budget exceeded")
    daemon.stop()
    (draining,) = events(daemon, "stopping: draining in-flight requests")
    assert draining["drain_timeout_s"] == 7.0


def test_model_config_reports_each_groups_kind_and_fraction(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """docs/api.md: Triton has no MPS kind, so each group's real kind and fraction are parameters."""
    repo = tmp_path / "repo"
    models.add_sub(
        repo,
        instance_group=[
            {"kind": "KIND_CPU", "count": 1},
            {"kind": "KIND_AUTO", "count": 1, "memory_fraction": 0.25},
        ],
    )
    daemon = start_daemon(repo, config=write_config(tmp_path / "mpsd.yaml"))
    daemon.wait_ready()
    config = daemon.client.get_model_config("add_sub", as_json=True)["config"]
    parameters = {k: v["string_value"] for k, v in config["parameters"].items()}
    assert parameters["mpsd.instance_group.0.kind"] == "KIND_CPU"
    assert parameters["mpsd.instance_group.1.kind"] == "KIND_AUTO"
    assert parameters["mpsd.instance_group.1.memory_fraction"] == "0.25"
    assert "mpsd.instance_group.0.memory_fraction" not in parameters


MPS_OOM = """
if float(inputs['x'].reshape(-1)[0]) > 0:
    raise RuntimeError(
        'MPS backend out of memory (MPS allocated: 17.11 GiB, other allocations: 1.34 GiB, max allowed: '
        '18.13 GiB). Tried to allocate 256.00 MiB on private pool.'
    )
return {'y': inputs['x']}
"""


def test_an_mps_out_of_memory_error_is_resource_exhausted_and_keeps_the_worker(
    tmp_path: Path, start_daemon: Callable[..., RunningDaemon]
) -> None:
    """The MPS allocator raises a plain RuntimeError; it is told from a bug by its message (a stand-in for
    MPS, which cannot run here: the model raises the MPS allocator's own message)."""
    repo = tmp_path / "repo"
    models.python_model(repo, "oom", MPS_OOM)
    daemon = start_daemon(repo, config=write_config(tmp_path / "mpsd.yaml"))
    daemon.wait_ready()
    (pid,) = daemon.started_workers("oom")
    inp = grpcclient.InferInput("x", [1], "FP32")
    inp.set_data_from_numpy(np.ones(1, np.float32))
    with pytest.raises(InferenceServerException) as info:
        daemon.client.infer("oom", [inp])
    assert info.value.status() == "StatusCode.RESOURCE_EXHAUSTED"
    assert "MPS backend out of memory" in info.value.message()
    inp.set_data_from_numpy(np.zeros(1, np.float32))
    assert daemon.client.infer("oom", [inp]).as_numpy("y").tolist() == [0.0]
    assert daemon.started_workers("oom") == [pid]
