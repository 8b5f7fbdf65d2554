"""A three-step ensemble against the same three models called by the client one after the other.

Three TorchScript models (each adds 1 to its input) and an ensemble of them, served by one daemon. The
client either sends the input to the ensemble once, or sends it to the first model, the first answer to
the second and the second's to the third, as a client without ensembles does. Both build each request
the same way (a ModelInferRequest with the tensor in raw contents). Small (FP32[1,16]) and 600 KB
(FP32[1,3,224,224]) inputs; one client (latency of a whole chain) and 16 chains in flight (chains per
second); interleaved rounds, medians.

    python -m bench.ensemble --out bench/results --name ensemble-cpu-2core
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from bench.side_by_side import request, run

STEPS = ("step0", "step1", "step2")


class AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def build_repo(repo: Path, dims: list[int]) -> None:
    tensor = {"data_type": "TYPE_FP32", "dims": dims}
    for name in STEPS:
        (repo / name / "1").mkdir(parents=True)
        torch.jit.save(torch.jit.script(AddOne()), str(repo / name / "1" / "model.pt"))
        config = {
            "max_batch_size": 8,
            "input": [{"name": "x", **tensor}],
            "output": [{"name": "y", **tensor}],
        }
        (repo / name / "config.yaml").write_text(yaml.safe_dump(config))
    names = ["IN", "a", "b", "OUT"]
    steps = [
        {"model_name": name, "input_map": {"x": names[i]}, "output_map": {"y": names[i + 1]}}
        for i, name in enumerate(STEPS)
    ]
    ensemble = {
        "backend": "ensemble",
        "max_batch_size": 8,
        "input": [{"name": "IN", **tensor}],
        "output": [{"name": "OUT", **tensor}],
        "ensemble_scheduling": {"step": steps},
    }
    (repo / "chain3" / "1").mkdir(parents=True)
    (repo / "chain3" / "config.yaml").write_text(yaml.safe_dump(ensemble))


async def ensemble_call(stub: Any, shape: list[int], data: bytes) -> bytes:
    response = await stub.ModelInfer(request("chain3", "IN", shape, data))
    return bytes(response.raw_output_contents[0])


async def client_chain(stub: Any, shape: list[int], data: bytes) -> bytes:
    for model in STEPS:
        response = await stub.ModelInfer(request(model, "x", shape, data))
        data = response.raw_output_contents[0]
    return bytes(data)


if __name__ == "__main__":
    run(
        __doc__ or "",
        "ensemble-cpu",
        build_repo,
        {"ensemble": ensemble_call, "client chain": client_chain},
        3.0,
    )
