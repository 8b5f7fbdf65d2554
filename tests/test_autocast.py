"""Mixed precision per model (`optimization.autocast`): the forward pass runs under torch.autocast for the
instance's device, and the outputs keep their declared datatypes.

Promises checked here:
- on the CPU, a bfloat16 TorchScript model answers close to float32 (within bfloat16's precision) but not
  exactly as float32 does, and its output is the declared FP32;
- inside a Python model's forward, a matmul runs in the autocast dtype (float16 and bfloat16 on the CPU)
  while its output comes back as the declared FP32;
- a combination torch does not support on a device is refused with torch's reason;
- on a CUDA GPU (skipped elsewhere), float16 autocast runs matmuls in float16 and answers in FP32.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from pydantic import ValidationError

from mpsd.config.model_config import ModelConfig
from mpsd.ipc.protocol import ModelSpec, TensorSpec
from mpsd.worker.autocast import autocast_problem, check_autocast
from tests import models
from tests.conftest import RunningDaemon, serving

DIM = 64
# The product is rounded to the autocast dtype: |y| reaches 7 here, where half a unit in the last place is
# 0.016 in bfloat16 (8 significant bits) and 0.002 in float16 (11); the largest errors measured on the CPU
# were 0.019 and 0.0037 (the inputs and weights are rounded too).
BF16_ATOL = 0.05
FP16_ATOL = 0.01
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}

PROBE_BODY = """
x = inputs["x"]
mm = x.unsqueeze(0) @ torch.eye(x.shape[0], device=x.device)
codes = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
return {"y": mm.squeeze(0), "mm_dtype": torch.tensor([codes[mm.dtype]], dtype=torch.int32)}
"""


class Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


def weight() -> torch.Tensor:
    return torch.rand(DIM, DIM, generator=torch.Generator().manual_seed(7)) * 2 - 1


def linear_model(repo: Path, name: str, kind: str, autocast: str | None) -> None:
    optimization = {"optimization": {"autocast": autocast}} if autocast else {}
    models.write_config(
        repo / name,
        {
            "backend": "torchscript",
            "max_batch_size": 8,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [DIM]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [DIM]}],
            "instance_group": [{"kind": kind}],
            **optimization,
        },
    )
    models.save_torchscript(Linear(weight()), repo / name / "1" / "model.pt")


def probe_model(repo: Path, name: str, kind: str, autocast: str) -> None:
    config = {
        "backend": "python",
        "max_batch_size": 0,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [
            {"name": "y", "data_type": "TYPE_FP32", "dims": [4]},
            {"name": "mm_dtype", "data_type": "TYPE_INT32", "dims": [1]},
        ],
        "instance_group": [{"kind": kind}],
        "optimization": {"autocast": autocast},
    }
    models.python_model(repo, name, PROBE_BODY, config=config)


def infer(daemon: RunningDaemon, model: str, x: np.ndarray) -> grpcclient.InferResult:
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    return daemon.client.infer(model, [inp])


def batch() -> np.ndarray:
    return np.random.default_rng(3).uniform(-1, 1, (4, DIM)).astype(np.float32)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningDaemon]:
    repo = tmp_path_factory.mktemp("autocast_repo")
    linear_model(repo, "linear_fp32", "KIND_CPU", None)
    linear_model(repo, "linear_bf16", "KIND_CPU", "bfloat16")
    probe_model(repo, "probe_fp16", "KIND_CPU", "float16")
    probe_model(repo, "probe_bf16", "KIND_CPU", "bfloat16")
    with serving(repo, tmp_path_factory.mktemp("autocast_logs") / "daemon.log") as running:
        yield running


def test_bfloat16_on_cpu_is_close_to_float32_and_answers_in_the_declared_fp32(daemon: RunningDaemon) -> None:
    x = batch()
    exact = x.astype(np.float64) @ weight().numpy().astype(np.float64)
    full = infer(daemon, "linear_fp32", x).as_numpy("y")
    result = infer(daemon, "linear_bf16", x)
    mixed = result.as_numpy("y")
    assert result.get_output("y").datatype == "FP32"
    assert full is not None and mixed is not None and mixed.dtype == np.float32
    np.testing.assert_allclose(full, exact, atol=1e-4)
    np.testing.assert_allclose(mixed, exact, atol=BF16_ATOL)
    assert np.abs(mixed - full).max() > 1e-3, "the bfloat16 model answered exactly as float32: no autocast"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_forward_runs_in_the_autocast_dtype_and_outputs_keep_their_type(
    daemon: RunningDaemon, dtype: str
) -> None:
    x = np.array([0.5, -1.25, 2.0, 3.0], dtype=np.float32)  # exact in both 16-bit formats
    result = infer(daemon, {"float16": "probe_fp16", "bfloat16": "probe_bf16"}[dtype], x)
    assert result.as_numpy("mm_dtype").tolist() == [DTYPE_CODES[dtype]]
    assert result.get_output("y").datatype == "FP32"
    np.testing.assert_array_equal(result.as_numpy("y"), x)


def test_autocast_dtype_is_one_torch_knows() -> None:
    base = {
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [4]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [4]}],
    }
    assert ModelConfig.model_validate(
        {**base, "optimization": {"autocast": "bfloat16"}}
    ).optimization.autocast
    with pytest.raises(ValidationError, match="autocast"):
        ModelConfig.model_validate({**base, "optimization": {"autocast": "float32"}})


def _spec(autocast: str) -> ModelSpec:
    tensor = (TensorSpec("x", "FP32", (4,)),)
    return ModelSpec("m", 1, "torchscript", "/none", 0, tensor, tensor, autocast=autocast)


def test_a_dtype_the_device_does_not_support_is_refused_with_torchs_reason() -> None:
    """torch.autocast disables itself with a warning for such a dtype; mpsd refuses instead."""
    assert autocast_problem("cpu", torch.bfloat16) is None
    problem = autocast_problem("cpu", torch.float64)
    assert problem is not None and "CPU Autocast only supports" in problem
    check_autocast(_spec("bfloat16"), torch.device("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where CUDA is missing")
def test_cuda_autocast_without_cuda_is_refused_at_load() -> None:
    with pytest.raises(ValueError, match=r"optimization.autocast float16 is not supported on cuda .*CUDA"):
        check_autocast(_spec("float16"), torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_float16_autocast_on_a_cuda_gpu(tmp_path: Path) -> None:
    linear_model(tmp_path, "linear_fp16", "KIND_GPU", "float16")
    probe_model(tmp_path, "probe_fp16", "KIND_GPU", "float16")
    with serving(tmp_path, tmp_path / "daemon.log") as daemon:
        x = batch()
        exact = x.astype(np.float64) @ weight().numpy().astype(np.float64)
        result = infer(daemon, "linear_fp16", x)
        assert result.get_output("y").datatype == "FP32"
        mixed = result.as_numpy("y")
        assert mixed is not None
        np.testing.assert_allclose(mixed, exact, atol=FP16_ATOL)
        assert np.abs(mixed - exact).max() > 1e-5, "answered in full precision: no autocast"
        probe = infer(daemon, "probe_fp16", np.array([0.5, -1.25, 2.0, 3.0], dtype=np.float32))
        assert probe.as_numpy("mm_dtype").tolist() == [DTYPE_CODES["float16"]]
        assert probe.get_output("y").datatype == "FP32"
