"""The config side of compiled models: backend aoti (its default file and Triton platform name) and
`optimization.compile` (where it applies, the batch sizes warm-up compiles at, config.pbtxt's mpsd.compile.*
parameters; config.pbtxt's protobuf code runs in a subprocess, as it cannot share a process with
tritonclient's).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from mpsd.config.model_config import ModelConfig
from tests.conftest import ROOT

FEATURES = 8
MAX_BATCH = 4
PBTXT = """
name: "tiny" platform: "torch_aoti" max_batch_size: 1
input [{name: "x" data_type: TYPE_FP32 dims: [1]}]
output [{name: "y" data_type: TYPE_FP32 dims: [1]}]
"""


def tiny_config(backend: str, **extra: Any) -> dict[str, Any]:
    return {
        "backend": backend,
        "max_batch_size": MAX_BATCH,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [FEATURES]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [FEATURES]}],
        **extra,
    }


def test_compile_applies_to_torch_export_and_python_models_only() -> None:
    compiled = {"optimization": {"compile": {"mode": "max-autotune", "dynamic": True}}}
    config = ModelConfig.model_validate(tiny_config("torch_export", **compiled))
    assert config.optimization.compile is not None and config.optimization.compile.dynamic is True
    assert config.compile_batch_sizes() == (1, MAX_BATCH)
    preferred = {"dynamic_batching": {"preferred_batch_size": [2]}}
    assert ModelConfig.model_validate(
        tiny_config("python", **compiled, **preferred)
    ).compile_batch_sizes() == (
        1,
        2,
        MAX_BATCH,
    )
    for backend, says in (("aoti", "compiled already"), ("torchscript", "cannot trace")):
        with pytest.raises(ValidationError, match=says):
            ModelConfig.model_validate(tiny_config(backend, **compiled))
    with pytest.raises(ValidationError, match="mode"):
        ModelConfig.model_validate(tiny_config("torch_export", optimization={"compile": {"mode": "fast"}}))
    assert ModelConfig.model_validate(tiny_config("aoti")).model_filename == "model.aoti.pt2"


ROUND_TRIP = """
import json, sys
from mpsd.config.model_config import ModelConfig
from mpsd.config.pbtxt import pbtxt_to_dict
from mpsd.config.pbtxt_write import config_to_pbtxt
configs, pbtxt = json.loads(sys.stdin.read())
back = [pbtxt_to_dict(config_to_pbtxt(ModelConfig.model_validate(c), "tiny"))[0] for c in configs]
print(json.dumps([*back, pbtxt_to_dict(pbtxt)[0]]))
"""


def test_aoti_and_compile_map_to_and_from_config_pbtxt() -> None:
    compiled = tiny_config(
        "torch_export", optimization={"compile": {"mode": "reduce-overhead", "dynamic": False}}
    )
    done = subprocess.run(
        [sys.executable, "-c", ROUND_TRIP],
        input=json.dumps([[compiled, tiny_config("aoti")], PBTXT]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=True,
    )
    back, aoti, platform = json.loads(done.stdout)
    assert back["optimization"]["compile"] == {"mode": "reduce-overhead", "dynamic": False}
    assert aoti["backend"] == "aoti"
    assert platform["backend"] == "aoti"
