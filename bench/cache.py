"""The response cache: a cache hit against a model call, on the same model, side by side.

One TorchScript model (x + 1) served twice by one daemon: `cached` with `response_cache: {enable: true}`
and `plain` without. The client sends the same request again and again, so every request to `cached` after
the first is a hit. Small (FP32[1,16]) and 600 KB (FP32[1,3,224,224]) inputs; one client (latency) and 16
in flight (requests per second); interleaved rounds, medians.

    python -m bench.cache --out bench/results --name cache-cpu-2core
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml

from bench.side_by_side import request, run


class AddOne(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


def build_repo(repo: Path, dims: list[int]) -> None:
    tensor = {"data_type": "TYPE_FP32", "dims": dims}
    for name in ("cached", "plain"):
        (repo / name / "1").mkdir(parents=True)
        torch.jit.save(torch.jit.script(AddOne()), str(repo / name / "1" / "model.pt"))
        config = {
            "max_batch_size": 8,
            "input": [{"name": "x", **tensor}],
            "output": [{"name": "y", **tensor}],
            "response_cache": {"enable": name == "cached"},
        }
        (repo / name / "config.yaml").write_text(yaml.safe_dump(config))


def calling(model: str) -> Any:
    async def call(stub: Any, shape: list[int], data: bytes) -> bytes:
        return bytes((await stub.ModelInfer(request(model, "x", shape, data))).raw_output_contents[0])

    return call


if __name__ == "__main__":
    run(
        __doc__ or "",
        "cache-cpu",
        build_repo,
        {"cache hit": calling("cached"), "model call": calling("plain")},
        1.0,
    )
