"""A model repository given through a symlink (macOS's /tmp and /var are symlinks): FSEvents names changed
files by their real paths, which the watcher must place under the repository; one path it cannot place is
logged and skipped, never the end of the watch. A daemon loading a model added through the symlink is
test_reload.py's."""

from __future__ import annotations

from pathlib import Path

from mpsd.daemon.core.watcher import model_of, watched_root


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
