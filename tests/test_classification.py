"""The classification extension through the real daemon with the stock tritonclient (gRPC and HTTP): top-K
classes as "value:index:label" strings, row by row for a batched model and whole for an unbatched one,
labels from the output's label file; and the label file's own failures, which fail that model's load."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient
import yaml
from tritonclient.utils import InferenceServerException

from mpsd.config.repository import load_model_source
from tests import models
from tests.conftest import RunningDaemon, serving

LABELS = ["cat", "dog", "", "bird"]  # index 2 has an empty label, index 4 none at all


def _with_labels(model_dir: Path, labels: list[str]) -> None:
    config = yaml.safe_load((model_dir / "config.yaml").read_text())
    config["output"][0]["label_filename"] = "labels.txt"
    models.write_config(model_dir, config)
    (model_dir / "labels.txt").write_text("".join(f"{label}\n" for label in labels))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    tmp = tmp_path_factory.mktemp("classification")
    repo = tmp / "repo"
    _with_labels(models.identity(repo, "scores", "TYPE_FP32", [5], max_batch_size=4), LABELS)
    models.identity(repo, "counts", "TYPE_INT32", [2, 2])
    models.identity(repo, "halves", "TYPE_FP16", [3])
    with serving(repo, tmp / "daemon.log") as d:
        yield d


SCORES = np.array([[0.1, 0.7, 0.2, 0.7, 0.05], [3.0, -1.0, 2.5, 0.0, 9.25]], dtype=np.float32)
# Descending, equal values lowest index first; values as C++'s std::to_string writes them.
TOP3 = [
    ["0.700000:1:dog", "0.700000:3:bird", "0.200000:2"],
    ["9.250000:4", "3.000000:0:cat", "2.500000:2"],
]


def test_grpc_top_classes_of_each_row_with_labels(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = grpcclient.InferInput("IN", list(SCORES.shape), "FP32")
    x.set_data_from_numpy(SCORES)
    result = client.infer("scores", [x], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=3)])
    out = result.as_numpy("OUT")
    assert result.get_output("OUT").datatype == "BYTES" and out.shape == (2, 3)
    assert [[e.decode() for e in row] for row in out] == TOP3


def test_http_top_classes_as_json_and_binary(daemon: RunningDaemon) -> None:
    client = httpclient.InferenceServerClient(daemon.http_address)
    x = httpclient.InferInput("IN", list(SCORES.shape), "FP32")
    x.set_data_from_numpy(SCORES)
    for binary in (False, True):
        wanted = httpclient.InferRequestedOutput("OUT", binary_data=binary, class_count=3)
        out = client.infer("scores", [x], outputs=[wanted]).as_numpy("OUT")
        got = [[e.decode() if isinstance(e, bytes) else e for e in row] for row in out]
        assert got == TOP3, binary


def test_unbatched_output_is_classified_whole_and_k_is_capped(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    counts = np.array([[5, -2], [7, 5]], dtype=np.int32)
    x = grpcclient.InferInput("IN", [2, 2], "INT32")
    x.set_data_from_numpy(counts)
    result = client.infer("counts", [x], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=10)])
    assert [e.decode() for e in result.as_numpy("OUT")] == ["7:2", "5:0", "5:3", "-2:1"]


def test_other_outputs_and_class_count_zero_keep_their_values(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = grpcclient.InferInput("IN", list(SCORES.shape), "FP32")
    x.set_data_from_numpy(SCORES)
    result = client.infer("scores", [x], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=0)])
    np.testing.assert_array_equal(result.as_numpy("OUT"), SCORES)


def test_a_type_triton_does_not_classify_is_refused_with_its_message(daemon: RunningDaemon) -> None:
    client = grpcclient.InferenceServerClient(daemon.address)
    x = grpcclient.InferInput("IN", [3], "FP16")
    x.set_data_from_numpy(np.ones(3, dtype=np.float16))
    with pytest.raises(InferenceServerException) as info:
        client.infer("halves", [x], outputs=[grpcclient.InferRequestedOutput("OUT", class_count=1)])
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT"
    assert info.value.message() == "class result not available for output due to unsupported type 'FP16'"


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
