"""A model repository given through a symlink (macOS's /tmp and /var are symlinks): FSEvents names changed
files by their real paths, which the watcher must place under the repository; one path it cannot place is
logged and skipped, never the end of the watch."""

from __future__ import annotations

import os
from pathlib import Path

from mpsd.daemon.core.watcher import model_of, watched_root
from tests import models
from tests.conftest import RunningDaemon, wait_for


def test_real_path_events_fall_under_a_repository_given_through_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    (real / "resnet" / "1").mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    root = watched_root(link)
    # As FSEvents reports them: by the real path, whatever path was watched.
    assert model_of(root, str(real / "resnet" / "1" / "model.pt")) == "resnet"
    assert model_of(root, str(real / "new_model")) == "new_model"
    assert model_of(root, str(real)) is None
    # As inotify reports them: under the path watched (the real one), or through the link.
    assert model_of(root, str(link / "resnet" / "config.pbtxt")) == "resnet"
    # A path outside the repository is skipped, not an error that ends the watch.
    assert model_of(root, str(tmp_path / "elsewhere" / "x")) is None


def test_a_model_added_to_a_symlinked_repository_after_start_is_loaded(start_daemon, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    real = tmp_path / "real"
    models.add_sub(real, name="first", dims=4)
    link = tmp_path / "link"
    link.symlink_to(real)
    config = tmp_path / "mpsd.yaml"
    config.write_text("reload_quiet_period_s: 0.3\nmetrics_address: ''\n")
    daemon: RunningDaemon = start_daemon(link, config=config)
    daemon.wait_ready()
    staging = tmp_path / "staging"
    models.add_sub(staging, name="second", dims=4)
    os.rename(staging / "second", real / "second")
    wait_for(lambda: daemon.client.is_model_ready("second"), 120, f"the added model to load\n{daemon.log()}")
    assert "repository watcher stopped" not in daemon.log()
