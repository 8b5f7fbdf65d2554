"""The operator tools as an operator runs them: `mpsd validate`, `mpsd infer`, `mpsd models` and
`mpsd init-model` in subprocesses, against files on disk and a real daemon."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as grpcclient
import yaml

from tests import models
from tests.conftest import ROOT, RunningDaemon, free_port, serving, wait_for

EX_UNAVAILABLE = 69


def mpsd(*args: str, cwd: Path = ROOT, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mpsd", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def one_line_error(result: subprocess.CompletedProcess[str], status: int, *words: str) -> None:
    """An expected failure: its exit status, one line naming the problem, one hint, no traceback.

    Progress lines may come first (init-model says what it loads)."""
    assert result.returncode == status, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) >= 2 and lines[-1].startswith("hint: "), result.stderr
    assert [ln for ln in lines if ln.startswith("mpsd ")] == [lines[-2]], result.stderr
    for word in words:
        assert word in lines[-2], f"{word!r} not in {lines[-2]!r}"


def build_examples(target: Path) -> Path:
    """The example repository of config/models, weights built as `make models` does."""
    shutil.copytree(ROOT / "config" / "models", target, ignore=shutil.ignore_patterns("*.pt", "*.pt2"))
    subprocess.run([sys.executable, "-m", "mpsd.examples", str(target)], check=True, capture_output=True)
    return target


@pytest.fixture(scope="module")
def example_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_examples(tmp_path_factory.mktemp("examples") / "models")


@pytest.fixture(scope="module")
def daemon(example_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    """A daemon watching its own copy of the example repository (init-model adds models to it)."""
    served = tmp_path_factory.mktemp("served") / "models"
    shutil.copytree(example_repo, served)
    strings = {"data_type": "TYPE_STRING", "dims": [-1]}
    models.python_model(
        served,
        "upper",
        "import numpy as np\nreturn {'UPPER': np.vectorize(bytes.upper, otypes=[object])(inputs['TEXT'])}",
        config={
            "backend": "python",
            "input": [{"name": "TEXT", **strings}],
            "output": [{"name": "UPPER", **strings}],
        },
    )
    with serving(served, tmp_path_factory.mktemp("log") / "daemon.log") as d:
        yield d


# ---- validate --------------------------------------------------------------------------------------------


def _set(model_dir: Path, path: list[str | int], value: object) -> None:
    config = yaml.safe_load((model_dir / "config.yaml").read_text())
    target = config
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    models.write_config(model_dir, config)


def broken_repository(repo: Path) -> None:
    """One valid model and six broken ones, one kind of mistake each."""
    models.add_sub(repo, "good")
    bad_yaml = models.add_sub(repo, "bad_yaml")
    unclosed = "backend: torchscript\ninput:\n  - {name: x, dims: [4]\noutput: []\n"
    (bad_yaml / "config.yaml").write_text(unclosed)
    models.add_sub(repo, "unknown_field", max_batch=4)
    missing = models.add_sub(repo, "missing_file")
    (missing / "1" / "model.pt").unlink()
    _set(models.add_sub(repo, "zero_dims"), ["input", 1, "dims"], [0])
    _set(models.add_sub(repo, "wrong_output"), ["output", 1, "dims"], [8])  # the model returns 16
    _set(models.add_sub(repo, "wrong_type"), ["output", 0, "data_type"], "TYPE_FP64")  # it returns FP32


# model -> (file the problem is reported in, field)
STATIC_PROBLEMS = {
    "bad_yaml": ("bad_yaml/config.yaml", ""),
    "unknown_field": ("unknown_field/config.yaml", "max_batch"),
    "missing_file": ("missing_file/1/model.pt", "backend"),
    "zero_dims": ("zero_dims/config.yaml", "input[1].dims"),
}
LOAD_PROBLEMS = {
    "wrong_output": ("wrong_output/config.yaml", "output[1].dims"),
    "wrong_type": ("wrong_type/config.yaml", "output[0].data_type"),
}


def test_validate_reports_every_mistake_with_file_field_and_hint(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    broken_repository(repo)

    # Without --load, four mistakes are visible in the files alone.
    result = mpsd("validate", str(repo))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    text = result.stdout
    for model, (file, field) in STATIC_PROBLEMS.items():
        line = next((ln for ln in text.splitlines() if ln.startswith(str(repo / file))), None)
        assert line is not None, f"{model} not reported:\n{text}"
        if field:
            assert f"field '{field}'" in line
    assert "did you mean 'max_batch_size'?" in text
    assert "invalid YAML" in text and "bad_yaml/config.yaml:4:" in text
    assert "wrong_output" not in text, "output dims can only be checked by loading the model"
    assert "wrong_type" not in text, "output datatypes can only be checked by loading the model"
    assert text.count("    hint: ") == len(STATIC_PROBLEMS)

    # With --load the warm-up finds the fifth; --json carries the same facts for tools.
    result = mpsd("validate", str(repo), "--load", "--json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is False
    found = {p["model"]: (p["file"], p["field"]) for p in report["problems"]}
    expected = {m: (str(repo / f), field) for m, (f, field) in {**STATIC_PROBLEMS, **LOAD_PROBLEMS}.items()}
    assert found == expected
    assert all(p["hint"] for p in report["problems"])
    wrong = next(p for p in report["problems"] if p["model"] == "wrong_output")
    assert "config dims [8]" in wrong["problem"] and wrong["hint"].startswith("set dims: [16]")
    wrong_type = next(p for p in report["problems"] if p["model"] == "wrong_type")
    assert "model returned FP32, config says FP64" in wrong_type["problem"]
    assert wrong_type["hint"].startswith("set data_type: TYPE_FP32") and wrong_type["line"] is not None
    by_name = {m["name"]: m for m in report["models"]}
    assert by_name["good"]["ok"] and by_name["good"]["loaded"] is True
    assert by_name["wrong_output"]["loaded"] is False and by_name["wrong_type"]["loaded"] is False
    assert "loading" in result.stderr  # progress goes to stderr, never into the JSON


TRITON_ADD_SUB = """
platform: "pytorch_libtorch"
max_batch_size: 8
input [
  { name: "INPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "INPUT1" data_type: TYPE_FP32 dims: [ 16 ] }
]
output [
  { name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 16 ] },
  { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 16 ] }
]
"""


def test_validate_shows_the_daemons_own_findings_whole_and_at_their_field(tmp_path: Path) -> None:
    """What the daemon's readers, placement rules and repository scan find is one problem each, at the
    field it is about, even where its text holds '; ' or ': '."""
    repo = tmp_path / "repo"
    for name, text in {
        "triton_dup": TRITON_ADD_SUB.replace('name: "INPUT1"', 'name: "INPUT0"'),
        "triton_onnx": TRITON_ADD_SUB.replace("pytorch_libtorch", "onnxruntime_onnx"),
    }.items():
        model = models.add_sub(repo, name)
        (model / "config.yaml").unlink()
        (model / "config.pbtxt").write_text(text)
    _set(models.add_sub(repo, "fallback"), ["parameters"], {"mps_fallback": "maybe"})
    linked = models.add_sub(repo, "linked") / "1" / "model.pt"
    linked.rename(tmp_path / "model.pt")
    linked.symlink_to(tmp_path / "model.pt")

    result = mpsd("validate", str(repo), "--json")
    assert result.returncode == 1, result.stdout + result.stderr
    problems = json.loads(result.stdout)["problems"]
    found = {p["model"]: p for p in problems}
    assert len(problems) == len(found) == 4, problems
    dup, onnx = found["triton_dup"], found["triton_onnx"]
    assert (dup["file"], dup["field"]) == (str(repo / "triton_dup" / "config.pbtxt"), "input")
    assert dup["problem"] == "input names must be unique; repeated: INPUT0"
    assert dup["hint"].startswith("a list of")
    assert onnx["field"] == "platform" and onnx["problem"].endswith(
        'platform "pytorch_libtorch", backend "pytorch" or backend "python"'
    )
    fallback = found["fallback"]
    assert (fallback["field"], fallback["problem"]) == (
        "parameters.mps_fallback",
        'expected "true" or "false", got \'maybe\'',
    )
    assert fallback["line"] is not None
    link = found["linked"]
    assert (link["file"], link["field"]) == (str(linked), "")
    assert link["problem"].endswith("; set allow_symlinks: true in the daemon config to allow it")


ENSEMBLE_PBTXT = """
name: "pipeline"
platform: "ensemble"
max_batch_size: 8
input [ { name: "A", data_type: TYPE_FP32, dims: [ 16 ] }, { name: "B", data_type: TYPE_FP32, dims: [ 16 ] } ]
output [ { name: "SUM", data_type: TYPE_FP32, dims: [ 16 ] } ]
ensemble_scheduling {
  step [
    { model_name: "add_sub", model_version: STEP_VERSION,
      input_map { key: "INPUT0" value: "A" }, input_map { key: "INPUT1" value: "B" },
      output_map { key: "OUTPUT0" value: "SUM" } }
  ]
}
"""


@pytest.mark.parametrize("form", ["config.pbtxt", "config.yaml"])
def test_validate_accepts_an_ensemble_and_checks_its_steps(tmp_path: Path, form: str) -> None:
    """An ensemble's version folder is empty (it has no model file); its steps are checked against the
    repository's models, in either config form."""
    repo = tmp_path / "repo"
    models.add_sub(repo)
    pipeline = repo / "pipeline"
    (pipeline / "1").mkdir(parents=True)

    def write(version: int, inputs: dict[str, str]) -> None:
        for old in pipeline.glob("config.*"):
            old.unlink()
        if form == "config.pbtxt":
            text = ENSEMBLE_PBTXT.replace("STEP_VERSION", str(version))
            if "INPUT1" not in inputs:
                text = text.replace(', input_map { key: "INPUT1" value: "B" }', "")
            (pipeline / form).write_text(text)
            return
        tensor = {"data_type": "TYPE_FP32", "dims": [16]}
        step = {"model_name": "add_sub", "model_version": version, "input_map": inputs}
        models.write_config(
            pipeline,
            {
                "backend": "ensemble",
                "max_batch_size": 8,
                "input": [{"name": "A", **tensor}, {"name": "B", **tensor}],
                "output": [{"name": "SUM", **tensor}],
                "ensemble_scheduling": {"step": [{**step, "output_map": {"OUTPUT0": "SUM"}}]},
            },
        )

    write(1, {"INPUT0": "A", "INPUT1": "B"})
    valid = mpsd("validate", str(repo))
    assert valid.returncode == 0, valid.stdout + valid.stderr
    assert "all 2 models are valid" in valid.stdout

    write(2, {"INPUT0": "A"})  # add_sub has version 1 only, and INPUT1 is not fed
    broken = mpsd("validate", str(repo), "--json")
    assert broken.returncode == 1, broken.stdout + broken.stderr
    found = {p["field"]: p for p in json.loads(broken.stdout)["problems"]}
    assert set(found) == {
        "ensemble_scheduling.step[0].model_version",
        "ensemble_scheduling.step[0].input_map",
    }
    assert all(p["model"] == "pipeline" and p["file"] == str(pipeline / form) for p in found.values())
    assert "serves no version 2 (1)" in found["ensemble_scheduling.step[0].model_version"]["problem"]
    assert "does not feed input(s) INPUT1" in found["ensemble_scheduling.step[0].input_map"]["problem"]
    if form == "config.yaml":
        assert found["ensemble_scheduling.step[0].input_map"]["line"] is not None

    shutil.rmtree(repo / "add_sub")
    gone = json.loads(mpsd("validate", str(repo), "--json").stdout)["problems"]
    assert [(p["field"], p["problem"]) for p in gone] == [
        ("ensemble_scheduling.step[0].model_name", "no model 'add_sub' in the repository")
    ]


def test_validate_warns_of_tritons_pytorch_options_but_not_of_the_thread_count_mpsd_reads(
    tmp_path: Path,
) -> None:
    repo = tmp_path / "repo"
    model = models.add_sub(repo, "triton")
    (model / "config.yaml").unlink()
    parameters = """
parameters [
  { key: "INTRA_OP_THREAD_COUNT" value: { string_value: "2" } },
  { key: "INTER_OP_THREAD_COUNT" value: { string_value: "2" } }
]
"""
    (model / "config.pbtxt").write_text(TRITON_ADD_SUB + parameters)
    result = mpsd("validate", str(repo))
    assert result.returncode == 0, result.stdout + result.stderr
    warnings = [line for line in result.stdout.splitlines() if ": warning: " in line]
    assert len(warnings) == 1 and "parameters.INTER_OP_THREAD_COUNT" in warnings[0], result.stdout
    bad = (
        (model / "config.pbtxt").read_text().replace('string_value: "2" } },', 'string_value: "two" } },', 1)
    )
    (model / "config.pbtxt").write_text(bad)
    refused = json.loads(mpsd("validate", str(repo), "--json").stdout)["problems"]
    assert [p["problem"] for p in refused] == ["expected a positive whole number, got 'two'"], refused


def test_validate_passes_the_example_repository(example_repo: Path) -> None:
    result = mpsd("validate", str(example_repo), "--load")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all 3 models are valid" in result.stdout


def test_validate_defaults_to_the_daemon_configs_repository(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    broken_repository(repo)
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "mpsd.yaml").write_text(f"model_repository: {repo}\n")
    result = mpsd("validate", "--json", cwd=tmp_path)
    assert result.returncode == 1
    assert json.loads(result.stdout)["repository"] == str(repo)

    missing = mpsd("validate", cwd=tmp_path / "config")
    one_line_error(missing, 1, "config/mpsd.yaml does not exist")


# ---- infer and models --------------------------------------------------------------------------------------


def test_infer_prints_outputs_as_table_and_json(daemon: RunningDaemon, tmp_path: Path) -> None:
    a = np.arange(16, dtype=np.float32)
    b = np.full(16, 0.5, dtype=np.float32)
    np.save(tmp_path / "b.npy", b)
    args = ["infer", "add_sub", "--address", daemon.address, "--input", f"INPUT0={json.dumps(a.tolist())}"]
    args += ["--input", f"INPUT1=@{tmp_path / 'b.npy'}"]

    table = mpsd(*args)
    assert table.returncode == 0, table.stderr
    rows = {line.split()[0]: line for line in table.stdout.splitlines()[2:]}
    assert rows["OUTPUT0"].split()[1:3] == ["FP32", "[1,"]
    assert "0.5,  1.5,  2.5" in rows["OUTPUT0"] and "15.5" in rows["OUTPUT0"]
    assert "-0.5,  0.5,  1.5" in rows["OUTPUT1"]

    result = mpsd(*args, "--output-format", "json")
    assert result.returncode == 0, result.stderr
    response = json.loads(result.stdout)
    assert response["model_version"] == "1"
    outputs = {o["name"]: o for o in response["outputs"]}
    assert outputs["OUTPUT0"]["shape"] == [1, 16]
    np.testing.assert_array_equal(outputs["OUTPUT0"]["data"], a + b)
    np.testing.assert_array_equal(outputs["OUTPUT1"]["data"], a - b)

    scaled = mpsd("infer", "scale", "--address", daemon.address, "-i", "x=[1, 2, 3]", "--output-format=json")
    assert scaled.returncode == 0, scaled.stderr
    assert json.loads(scaled.stdout)["outputs"][0]["data"] == [2.5, 5.0, 7.5]

    text = mpsd(
        "infer", "upper", "--address", daemon.address, "-i", 'TEXT=["ab", "wörd"]', "--output-format=json"
    )
    assert text.returncode == 0, text.stderr
    out = json.loads(text.stdout)["outputs"][0]
    assert (out["datatype"], out["shape"], out["data"]) == ("BYTES", [2], ["AB", "WöRD"])


def test_infer_writes_npy_outputs(daemon: RunningDaemon, tmp_path: Path) -> None:
    images = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    out = tmp_path / "out"
    result = mpsd(
        "infer", "tiny_cnn", "--address", daemon.address, "-i", f"image=@{tmp_path / 'images.npy'}",
        "--output-format", "npy", "--output-dir", str(out),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(out / "logits.npy")
    reference = grpcclient.InferInput("image", list(images.shape), "FP32")
    reference.set_data_from_numpy(images)
    expected = daemon.client.infer("tiny_cnn", [reference]).as_numpy("logits")
    assert expected.shape == (2, 10)
    np.testing.assert_array_equal(np.load(out / "logits.npy"), expected)


def test_infer_and_models_fail_in_one_line_with_a_hint(daemon: RunningDaemon) -> None:
    address = ["--address", daemon.address]
    one_line_error(mpsd("infer", "nope", *address, "-i", "x=1"), 1, "NOT_FOUND", "nope")
    one_line_error(mpsd("infer", "add_sub", *address, "-i", "INPUT0=[1,2,3]", "-i", "INPUT1=1"), 1, "[3]")
    one_line_error(mpsd("infer", "add_sub", *address, "-i", "INPUT0=1"), 1, "missing input", "INPUT1")
    one_line_error(mpsd("infer", "add_sub", *address, "-i", "INPUT0=abc", "-i", "INPUT1=1"), 1, "not JSON")
    nobody = f"127.0.0.1:{free_port()}"
    one_line_error(mpsd("infer", "add_sub", "--address", nobody, "-i", "x=1"), EX_UNAVAILABLE, nobody)
    one_line_error(mpsd("models", "--address", nobody), EX_UNAVAILABLE, nobody)

    listing = mpsd("models", *address)
    assert listing.returncode == 0, listing.stderr
    states = {line.split()[0]: line.split()[2] for line in listing.stdout.splitlines()[1:]}
    assert {states.get(m) for m in ("add_sub", "scale", "tiny_cnn")} == {"READY"}, listing.stdout


# ---- init-model ----------------------------------------------------------------------------------------


def test_init_model_writes_a_config_that_serves(
    example_repo: Path, daemon: RunningDaemon, tmp_path: Path
) -> None:
    """Models written into a watched repository are picked up and answer, with no config written by hand."""
    repo = daemon.repo
    source = tmp_path / "adder.pt"
    models.save_torchscript(models.AddSub(), source)
    result = mpsd(
        "init-model", "adder", "--from", str(source), "--repository", str(repo),
        "--example-input", "4:FP32", "--example-input", "4:FP32", "--max-batch-size", "4",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load((repo / "adder" / "config.yaml").read_text())
    assert config["max_batch_size"] == 4
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("a", "TYPE_FP32", [4]),
        ("b", "TYPE_FP32", [4]),
    ]
    assert [(t["name"], t["dims"]) for t in config["output"]] == [("OUTPUT0", [4]), ("OUTPUT1", [4])]
    assert (repo / "adder" / "1" / "model.pt").read_bytes() == source.read_bytes()
    assert not [p for p in repo.iterdir() if p.name.startswith(".")], "a staging directory was left behind"

    # A torch.export program needs no example inputs: its shapes, and the dynamic batch, are recorded.
    program = example_repo / "tiny_cnn" / "1" / "model.pt2"
    result = mpsd("init-model", "cnn", "--from", str(program), "--repository", str(repo))
    assert result.returncode == 0, result.stderr
    cnn = yaml.safe_load((repo / "cnn" / "config.yaml").read_text())
    assert (cnn["backend"], cnn["max_batch_size"]) == ("torch_export", 16)
    assert (cnn["input"][0]["name"], cnn["input"][0]["dims"], cnn["output"][0]["dims"]) == (
        "x",
        [3, 32, 32],
        [10],
    )

    again = mpsd("init-model", "adder", "--from", str(source), "--repository", str(repo))
    one_line_error(again, 1, "already exists")
    too_few = mpsd("init-model", "other", "--from", str(source), "--repository", str(repo))
    one_line_error(too_few, 1, "forward() takes 2 input(s) (a, b)")

    for name in ("adder", "cnn"):
        wait_for(lambda n=name: daemon.client.is_model_ready(n), 120, f"{name} ready\n{daemon.log()}")
    address = ["--address", daemon.address, "--output-format", "json"]
    added = mpsd("infer", "adder", *address, "-i", "a=[1, 2, 3, 4]", "-i", "b=[10, 20, 30, 40]")
    assert added.returncode == 0, added.stderr
    outputs = {o["name"]: o["data"] for o in json.loads(added.stdout)["outputs"]}
    assert outputs == {"OUTPUT0": [11.0, 22.0, 33.0, 44.0], "OUTPUT1": [-9.0, -18.0, -27.0, -36.0]}
    classified = mpsd("infer", "cnn", *address, "-i", "x=0")
    assert classified.returncode == 0, classified.stderr
    assert json.loads(classified.stdout)["outputs"][0]["shape"] == [1, 10]
