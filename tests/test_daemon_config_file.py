"""The daemon's config file and the repository's names as docs/daemon-config.md and docs/configuration.md
give them, read in-process: the settings that turn a listener off, paths relative to the file, where an
upload directory may be, and which folder names are models and versions."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from mpsd.cli.serve import check_servable
from mpsd.config.daemon_config import DaemonConfig, load_daemon_config
from mpsd.config.model_config import ModelConfig
from mpsd.config.repository import model_name_problem, scan_repository
from mpsd.errors import ConfigError
from mpsd.net.listen import http_address, openai_address
from tests import models


def test_a_bare_off_turns_each_listener_off(tmp_path: Path) -> None:
    """YAML reads a bare `off` as false; the docs write it bare, and it must mean off, not a type error."""
    path = tmp_path / "mpsd.yaml"
    path.write_text("http_address: off\nopenai_address: off\nmetrics_address: off\n")
    config = load_daemon_config(path)
    assert (config.http_address, config.openai_address, config.metrics_address) == ("off", "off", "off")
    assert http_address(config.http_address) is None and openai_address(config.openai_address) is None


def test_relative_paths_follow_the_config_file_not_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "up").mkdir()
    for name in ("cert.pem", "key.pem", "ca.pem"):
        (tmp_path / name).write_bytes(b"-----BEGIN-----\n")
    settings = {
        "model_upload_dir": "up",
        "tls": {"cert_file": "cert.pem", "key_file": "key.pem", "client_ca_file": "ca.pem"},
    }
    path = tmp_path / "mpsd.yaml"
    path.write_text(yaml.safe_dump(settings))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    config = load_daemon_config(path)
    assert config.model_upload_dir == tmp_path / "up"
    assert config.tls is not None and config.tls.client_ca_file == tmp_path / "ca.pem"


def test_the_upload_directory_must_exist_outside_the_repository(tmp_path: Path) -> None:
    repo = tmp_path / "models"
    (repo / "up").mkdir(parents=True)
    (tmp_path / "up").mkdir()
    with pytest.raises(ConfigError, match="inside the model repository"):
        check_servable(DaemonConfig(model_repository=repo, model_upload_dir=repo / "up"), event_loop=False)
    with pytest.raises(ConfigError, match="is not a directory"):
        check_servable(
            DaemonConfig(model_repository=repo, model_upload_dir=tmp_path / "no"), event_loop=False
        )
    check_servable(DaemonConfig(model_repository=repo, model_upload_dir=tmp_path / "up"), event_loop=False)


def test_model_names_are_1_to_128_characters_not_starting_with_a_dot_or_a_dash() -> None:
    for good in ("a", "a" * 128, "resnet-50.v2_fp16", "_private"):
        assert model_name_problem(good) is None, good
    for bad in ("", "a" * 129, "-x", ".x", "a/b", "a b"):
        assert model_name_problem(bad) is not None, bad


def test_a_version_is_a_positive_integer_written_canonically(tmp_path: Path) -> None:
    """`0` and `01` are folders beside the versions, ignored as Triton ignores them."""
    repo = tmp_path / "models"
    models.add_sub(repo, version_policy={"all": {}})
    for name in ("0", "01", "2"):
        (repo / "add_sub" / name).mkdir()
        (repo / "add_sub" / name / "model.pt").hardlink_to(repo / "add_sub" / "1" / "model.pt")
    model = scan_repository(repo)["add_sub"]
    assert model.error is None and model.versions == (1, 2)


def test_a_sequence_idle_time_of_0_is_the_default_second() -> None:
    """docs/configuration.md, as Triton: `max_sequence_idle_microseconds: 0` is the default 1 s, not none."""
    config = ModelConfig.model_validate(
        {
            "backend": "python",
            "max_batch_size": 4,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [1]}],
            "sequence_batching": {"max_sequence_idle_microseconds": 0},
        }
    )
    assert config.sequence_batching is not None and config.sequence_batching.idle_s == 1.0
