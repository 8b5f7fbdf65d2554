"""Counting CUDA GPUs without torch: the driver's list under /proc, narrowed by CUDA_VISIBLE_DEVICES.

The driver's list is a stand-in directory here (this machine has no NVIDIA driver); the daemon-level test
that spreads a model over real GPUs is in tests/test_placement_gpus.py and runs where there are two.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mpsd.daemon.supervise.gpus import cuda_gpu_count


@pytest.fixture
def driver_list(tmp_path: Path) -> Path:
    gpus = tmp_path / "gpus"
    for bus in ("0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"):
        (gpus / bus).mkdir(parents=True)
    return gpus


@pytest.mark.parametrize(
    ("visible", "count"),
    [
        (None, 3),  # unset: every GPU the driver lists
        ("1,2", 2),
        ("2", 1),
        ("GPU-8f1c,GPU-77ab", 2),  # UUIDs count like indices
        ("0,-1,2", 1),  # CUDA stops at the first invalid entry
        ("-1", 0),
        ("", 0),
        ("0,1,2,3,4", 3),  # the list ends at the first index past the last GPU
        ("1,5", 1),
        ("5,0", 0),
        ("0,0", 0),  # an index given twice hides every GPU
        ("2,GPU-8f1c", 2),
    ],
)
def test_visible_devices_narrow_the_drivers_list(driver_list: Path, visible: str | None, count: int) -> None:
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert cuda_gpu_count(env, driver_list) == count


def test_no_driver_list_means_no_gpus(tmp_path: Path) -> None:
    assert cuda_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, tmp_path / "missing") == 0
