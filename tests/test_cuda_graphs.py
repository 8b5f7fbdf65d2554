"""CUDA graphs (`optimization.cuda.graphs`): which batch sizes are recorded, what the config refuses, what
a worker off CUDA says, and, where torch sees a CUDA GPU, that batches replay a recorded graph with the
model's own answers (tests marked so skip elsewhere)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as grpcclient
from pydantic import ValidationError
from torch import nn

from mpsd.config.model_config import ModelConfig
from mpsd.ipc.protocol import BucketSpec, ModelSpec, TensorSpec
from mpsd.worker.cuda_graphs import GraphedBackend, graph_size
from tests import models
from tests.conftest import RunningDaemon, serving

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


def config(**extra: Any) -> ModelConfig:
    base: dict[str, Any] = {
        "max_batch_size": 64,
        "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 8, 8]}],
        "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}],
    }
    return ModelConfig.model_validate({**base, **extra})


def test_graphs_are_off_unless_asked_for() -> None:
    assert config().cuda_graph_batch_sizes() == ()


def test_default_sizes_are_steps_the_preferred_sizes_and_the_maximum() -> None:
    on = {"cuda": {"graphs": True}}
    assert config(optimization=on).cuda_graph_batch_sizes() == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    odd = config(optimization=on, max_batch_size=45, dynamic_batching={"preferred_batch_size": [21]})
    assert odd.cuda_graph_batch_sizes() == (1, 2, 4, 8, 16, 21, 24, 32, 40, 45)
    large = config(optimization=on, max_batch_size=1000).cuda_graph_batch_sizes()
    assert large[:7] == (1, 2, 4, 8, 16, 32, 64) and large[-2:] == (960, 1000)  # a step of 64
    assert len(large) == 22 and all(b - a <= 64 for a, b in itertools.pairwise(large))
    single = config(optimization=on, max_batch_size=1).cuda_graph_batch_sizes()
    assert single == (1,)
    beyond = config(optimization=on, max_batch_size=8, dynamic_batching={"preferred_batch_size": [100]})
    assert beyond.cuda_graph_batch_sizes() == (1, 2, 4, 8)  # never above max_batch_size


def test_graph_spec_names_the_sizes() -> None:
    spec = {
        "cuda": {"graphs": True, "graph_spec": [{"batch_size": 16}, {"batch_size": 4}, {"batch_size": 16}]}
    }
    assert config(optimization=spec).cuda_graph_batch_sizes() == (4, 16)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"max_batch_size": 0}, "needs max_batch_size > 0"),
        (
            {"input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, -1]}]},
            "needs fixed input dims (or shape_buckets for them); variable (-1) in: x",
        ),
        (
            {"input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3], "optional": True}]},
            "cannot record optional inputs: x",
        ),
        ({"graph_spec": [{"batch_size": 128}]}, "graph_spec batch_size 128 exceeds max_batch_size 64"),
        ({"graph_spec": [{"batch_size": 0}]}, "greater than or equal to 1"),
        ({"graphs": False, "graph_spec": [{"batch_size": 4}]}, "graph_spec is set but"),
        ({"backend": "python"}, "not python"),
    ],
)
def test_what_cannot_be_recorded_is_refused(extra: dict[str, Any], message: str) -> None:
    cuda = {"graphs": True, **{k: v for k, v in extra.items() if k in ("graphs", "graph_spec")}}
    rest = {k: v for k, v in extra.items() if k not in ("graphs", "graph_spec")}
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        config(optimization={"cuda": cuda}, **rest)


def test_a_batch_takes_the_smallest_graph_that_holds_it() -> None:
    sizes = (1, 2, 4, 8)
    assert [graph_size(sizes, n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, None]
    assert graph_size((), 1) is None


def test_off_cuda_the_setting_is_reported_and_requests_are_served(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    models.add_sub(
        repo,
        dims=4,
        instance_group=[{"kind": "KIND_CPU", "count": 1}],
        optimization={"cuda": {"graphs": True, "graph_spec": [{"batch_size": 2}, {"batch_size": 8}]}},
    )
    with serving(repo, tmp_path / "daemon.log") as daemon:
        inputs = []
        for name in ("INPUT0", "INPUT1"):
            inp = grpcclient.InferInput(name, [3, 4], "FP32")
            inp.set_data_from_numpy(np.full((3, 4), 2.0, np.float32))
            inputs.append(inp)
        result = daemon.client.infer("add_sub", inputs)
        np.testing.assert_array_equal(result.as_numpy("OUTPUT0"), np.full((3, 4), 4.0, np.float32))
        cuda = daemon.client.get_model_config("add_sub", as_json=True)["config"]["optimization"]["cuda"]
        events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    assert cuda == {"graphs": True, "graph_spec": [{"batch_size": 2}, {"batch_size": 8}]}
    (ready,) = [e for e in events if e["event"] == "worker ready"]
    assert ready["cuda_graphs"] == "off: not on a CUDA device (cpu)"


class SmallCnn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.norm = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(torch.relu(self.norm(self.conv(x))).mean((2, 3)))
        return out


def cnn_spec(sizes: tuple[int, ...]) -> ModelSpec:
    return ModelSpec(
        name="cnn",
        version=1,
        backend="torchscript",
        model_path="",
        max_batch_size=8,
        inputs=(TensorSpec("x", "FP32", (3, 8, 8)),),
        outputs=(TensorSpec("y", "FP32", (10,)),),
        cuda_graph_batch_sizes=sizes,
    )


class Counting:
    """The model as a backend, counting the calls that reach it (a replay does not)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls = 0

    def __call__(self, inputs: Any) -> dict[str, torch.Tensor]:
        self.calls += 1
        return {"y": self.module(*inputs)}


@needs_cuda
def test_batches_replay_the_smallest_graph_and_match_the_model() -> None:
    torch.manual_seed(0)
    module = torch.jit.script(SmallCnn().eval().cuda())
    model = Counting(module)
    with torch.inference_mode():
        graphed = GraphedBackend(model, cnn_spec((2, 4)), torch.device("cuda"))
        assert graphed.sizes == (2, 4)
        recorded = model.calls
        for rows in (3, 1, 4, 2):  # each smaller than the last graph's batch: padding rows hold old data
            x = torch.randn(rows, 3, 8, 8, device="cuda")
            got = graphed([x])["y"].clone()
            torch.testing.assert_close(got, module(x), rtol=1e-4, atol=1e-4)
            got = graphed([x.cpu().pin_memory()])["y"].clone()  # from host memory, as the worker passes them
            assert got.shape == (rows, 10)
            torch.testing.assert_close(got, module(x), rtol=1e-4, atol=1e-4)
        assert model.calls == recorded, "a batch that fits a graph must not call the model"
        big = torch.randn(8, 3, 8, 8, device="cuda")
        torch.testing.assert_close(graphed([big])["y"], module(big), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(graphed([big.cpu()])["y"], module(big), rtol=1e-4, atol=1e-4)
        assert model.calls == recorded + 2, "a batch larger than every graph runs the model itself"


class MaskedSum(nn.Module):
    """Each row's sum over its real positions (the mask's), times a weight: rows do not depend on padding."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(3.0))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return (x * mask.to(x.dtype)).sum(1, keepdim=True) * self.weight


@needs_cuda
def test_a_bucketed_model_has_a_graph_per_batch_size_and_bucket() -> None:
    module = torch.jit.script(MaskedSum().eval().cuda())
    model = Counting(module)
    spec = ModelSpec(
        name="masked",
        version=1,
        backend="torchscript",
        model_path="",
        max_batch_size=4,
        inputs=(TensorSpec("x", "FP32", (-1,)), TensorSpec("MASK", "INT64", (-1,))),
        outputs=(TensorSpec("y", "FP32", (1,)),),
        cuda_graph_batch_sizes=(2, 4),
        buckets=(BucketSpec(0, 1, (4, 8)),),
        mask_follows=0,
    )
    with torch.inference_mode():
        graphed = GraphedBackend(model, spec, torch.device("cuda"))
        assert sorted(graphed._graphs) == [(2, (4,)), (2, (8,)), (4, (4,)), (4, (8,))]
        recorded = model.calls
        for rows, length in ((3, 8), (1, 4), (4, 4), (2, 8)):
            x = torch.randn(rows, length, device="cuda")
            mask = (torch.arange(length, device="cuda") < length - 1).to(torch.int64).expand(rows, length)
            got = graphed([x, mask.contiguous()])["y"].clone()
            torch.testing.assert_close(got, module(x, mask), rtol=1e-4, atol=1e-4)
        assert model.calls == recorded, "a batch padded to a bucket must replay its graph"
        odd = torch.randn(2, 5, device="cuda")  # not a bucket: the model itself
        graphed([odd, torch.ones(2, 5, dtype=torch.int64, device="cuda")])
        assert model.calls == recorded + 1


@needs_cuda
def test_a_model_whose_answers_come_from_more_than_its_gpu_work_is_refused() -> None:
    """Python state feeds the answer: recorded once, a replay would repeat it; the check after recording
    compares a replay with a direct call and refuses the graphs."""
    calls = [0]

    def stateful(inputs: Any) -> dict[str, torch.Tensor]:
        calls[0] += 1
        return {"y": inputs[0].mean((2, 3)).repeat(1, 4)[:, :10] + float(calls[0])}

    with torch.inference_mode(), pytest.raises(RuntimeError, match="answers differently from the model"):
        GraphedBackend(stateful, cnn_spec((2, 4)), torch.device("cuda"))

    def on_host(inputs: Any) -> dict[str, torch.Tensor]:
        inputs[0].mul(2)  # some GPU work: a graph with none is refused as empty before outputs are checked
        return {"y": torch.zeros(inputs[0].shape[0], 10)}

    with torch.inference_mode(), pytest.raises(RuntimeError, match="output 'y' is on cpu"):
        GraphedBackend(on_host, cnn_spec((2,)), torch.device("cuda"))

    def no_gpu_work(inputs: Any) -> dict[str, torch.Tensor]:
        return {"y": torch.zeros(inputs[0].shape[0], 10)}

    with torch.inference_mode(), pytest.raises(RuntimeError, match="recording a CUDA graph at batch size 2"):
        GraphedBackend(no_gpu_work, cnn_spec((2,)), torch.device("cuda"))


class Syncs(nn.Module):
    """Reads a value back to the host mid-call: that cannot be recorded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(x.sum().item() >= 0)
        return x.mean((2, 3)).repeat(1, 4)[:, :10] * scale


def gpu_model(repo: Path, name: str, module: nn.Module, max_batch_size: int, graph_sizes: list[int]) -> None:
    """An x FP32[3,8,8] -> y FP32[10] TorchScript model on the GPU, with CUDA graphs at `graph_sizes`."""
    models.save_torchscript(module, repo / name / "1" / "model.pt")
    graph_spec = [{"batch_size": s} for s in graph_sizes]
    models.write_config(
        repo / name,
        {
            "backend": "torchscript",
            "max_batch_size": max_batch_size,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [3, 8, 8]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [10]}],
            # gpus: one worker, also where there are several GPUs (unpinned, there would be one on each)
            "instance_group": [{"kind": "KIND_GPU", "count": 1, "gpus": [0]}],
            "optimization": {"cuda": {"graphs": True, "graph_spec": graph_spec}},
        },
    )


@needs_cuda
def test_a_model_that_cannot_be_recorded_fails_to_load_naming_the_batch_size(tmp_path: Path) -> None:
    """In the daemon's worker, not here: a failed recording leaves that process's CUDA state behind."""
    repo = tmp_path / "repo"
    gpu_model(repo, "syncs", Syncs(), max_batch_size=4, graph_sizes=[4])
    daemon = RunningDaemon(repo, tmp_path / "daemon.log")
    try:
        daemon.wait_models_settled()
        (entry,) = daemon.client.get_model_repository_index(as_json=True)["models"]
    finally:
        daemon.stop()
        daemon.kill_group()
    assert entry["state"] == "UNAVAILABLE"
    assert "recording a CUDA graph at batch size 4 failed" in entry["reason"], entry


@needs_cuda
def test_the_daemon_records_graphs_and_serves_from_them(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    torch.manual_seed(0)
    module = SmallCnn().eval()
    gpu_model(repo, "cnn", module, max_batch_size=8, graph_sizes=[2, 4])
    with serving(repo, tmp_path / "daemon.log") as daemon:
        for rows in (1, 3, 4, 8):
            x = np.random.default_rng(rows).standard_normal((rows, 3, 8, 8)).astype(np.float32)
            inp = grpcclient.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            got = daemon.client.infer("cnn", [inp]).as_numpy("y")
            with torch.inference_mode():
                want = module(torch.from_numpy(x)).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3)
        events = [json.loads(line) for line in daemon.log().splitlines() if line.startswith("{")]
    (ready,) = [e for e in events if e["event"] == "worker ready"]
    assert ready["device"] == "cuda"
    assert ready["cuda_graphs"] == [2, 4]
    assert ready["cuda_graphs_ms"] > 0
