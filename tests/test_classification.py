"""The classification extension in one process (api/classification.py through the pipeline, `Operations`,
over a fake registry whose model versions have fake data planes answering with the input): top-K classes as
"value:index:label" strings, row by row for a batched model and whole for an unbatched one, labels from the
output's label file; and the label file's own failures, which fail that model's load. The extension over
the wire (tritonclient's `class_count`, gRPC and HTTP) is test_infer.py's."""

from __future__ import annotations

import asyncio
import struct
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
import yaml

from mpsd.config.repository import load_model_source
from mpsd.daemon.api.call import InferCall, InputCall, OutputCall, Param
from mpsd.daemon.api.operations import Operations
from mpsd.errors import ErrorCode, MpsdError
from tests import models
from tests.test_pipeline import Registry, Version, config

LABELS = ["cat", "dog", "", "bird"]  # index 2 has an empty label, index 4 none at all


def _with_labels(model_dir: Path, labels: list[str]) -> None:
    config = yaml.safe_load((model_dir / "config.yaml").read_text())
    config["output"][0]["label_filename"] = "labels.txt"
    models.write_config(model_dir, config)
    (model_dir / "labels.txt").write_text("".join(f"{label}\n" for label in labels))


SCORES = np.array([[0.1, 0.7, 0.2, 0.7, 0.05], [3.0, -1.0, 2.5, 0.0, 9.25]], dtype=np.float32)
# Descending, equal values lowest index first; values as C++'s std::to_string writes them.
TOP3 = [
    ["0.700000:1:dog", "0.700000:3:bird", "0.200000:2"],
    ["9.250000:4", "3.000000:0:cat", "2.500000:2"],
]


def _classified(
    version: Version, x: np.ndarray, datatype: str, count: int
) -> tuple[str, tuple[int, ...], Any]:
    """The output `y` of `x` through the pipeline with `count` classes asked for: its datatype, shape and
    elements (strings, or the values when it is not classified)."""
    ops = Operations(cast(Any, Registry(version)), lambda: False)
    wanted = OutputCall("y", {"classification": Param("int64", count)})
    call = InferCall(
        version.name, "", "r", {}, (InputCall("x", datatype, x.shape),), (wanted,), (x.tobytes(),)
    )
    out = asyncio.run(ops.infer(call)).result.outputs[0]
    if out.datatype != "BYTES":
        return out.datatype, out.shape, np.frombuffer(out.data, x.dtype).reshape(out.shape)
    data, strings = bytes(out.data), []
    while data:
        (n,) = struct.unpack_from("<I", data)
        strings.append(data[4 : 4 + n].decode())
        data = data[4 + n :]
    return out.datatype, out.shape, strings


def test_top_classes_of_each_row_with_labels() -> None:
    scores = Version("scores", 1, config([5], max_batch_size=4), labels={"y": tuple(LABELS)})
    datatype, shape, elements = _classified(scores, SCORES, "FP32", 3)
    assert (datatype, shape) == ("BYTES", (2, 3))
    assert [elements[:3], elements[3:]] == TOP3


def test_unbatched_output_is_classified_whole_and_k_is_capped() -> None:
    counts = np.array([[5, -2], [7, 5]], dtype=np.int32)
    datatype, shape, elements = _classified(
        Version("counts", 1, config([2, 2], "TYPE_INT32")), counts, "INT32", 10
    )
    assert (datatype, shape, elements) == ("BYTES", (4,), ["7:2", "5:0", "5:3", "-2:1"])


def test_other_outputs_and_class_count_zero_keep_their_values() -> None:
    scores = Version("scores", 1, config([5], max_batch_size=4), labels={"y": tuple(LABELS)})
    datatype, shape, values = _classified(scores, SCORES, "FP32", 0)
    assert (datatype, shape) == ("FP32", (2, 5))
    np.testing.assert_array_equal(values, SCORES)


def test_a_type_triton_does_not_classify_is_refused_with_its_message() -> None:
    halves = Version("halves", 1, config([3], "TYPE_FP16"))
    with pytest.raises(MpsdError) as info:
        _classified(halves, np.ones(3, dtype=np.float16), "FP16", 1)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert info.value.message == "class result not available for output due to unsupported type 'FP16'"


def test_a_negative_class_count_is_refused() -> None:
    with pytest.raises(MpsdError) as info:
        _classified(Version("counts", 1, config([2], "TYPE_INT32")), np.ones(2, np.int32), "INT32", -1)
    assert info.value.code == ErrorCode.INVALID_ARGUMENT
    assert "parameter 'classification' must be a non-negative integer" in info.value.message


def test_label_file_problems_fail_the_model_naming_the_field(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    model_dir = models.identity(repo, "labelled", "TYPE_FP32", [3])
    _with_labels(model_dir, ["a", "b", "c"])
    source = load_model_source(model_dir)
    assert source.ok and source.labels == {"OUT": ("a", "b", "c")}

    (model_dir / "labels.txt").unlink()
    missing = load_model_source(model_dir)
    assert missing.issues[0].loc == ("output", 0, "label_filename")
    assert f"label file 'labels.txt' does not exist in {model_dir}" in str(missing.error)

    (tmp_path / "outside.txt").write_text("x\n")
    (model_dir / "labels.txt").symlink_to(tmp_path / "outside.txt")
    assert "'labels.txt' is outside the model's folder" in str(load_model_source(model_dir).error)


def test_new_labels_make_a_new_version(tmp_path: Path) -> None:
    """Labels are part of what a version is: changing the file changes its fingerprint (a reload)."""
    model_dir = models.identity(tmp_path / "repo", "labelled", "TYPE_FP32", [3])
    _with_labels(model_dir, ["a", "b", "c"])
    before = load_model_source(model_dir).version_fingerprints[1]
    (model_dir / "labels.txt").write_text("a\nb\nC\n")
    assert load_model_source(model_dir).version_fingerprints[1] != before
