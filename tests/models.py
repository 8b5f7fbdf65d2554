"""Real models built by the tests: TorchScript and torch.export files and Python models written to disk."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml
from torch import nn


class AddSub(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class Identity(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class Constant(nn.Module):
    """Adds a fixed value, so each version of a model answers differently."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.value


class DictOut(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"doubled": x * 2, "negated": -x}


def write_config(model_dir: Path, config: dict[str, Any]) -> None:
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))


def save_torchscript(module: nn.Module, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.jit.save(torch.jit.script(module), str(path))


def add_sub(repo: Path, name: str = "add_sub", dims: int = 16, max_batch_size: int = 8, **extra: Any) -> Path:
    model_dir = repo / name
    write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": max_batch_size,
            "input": [
                {"name": "INPUT0", "data_type": "TYPE_FP32", "dims": [dims]},
                {"name": "INPUT1", "data_type": "TYPE_FP32", "dims": [dims]},
            ],
            "output": [
                {"name": "OUTPUT0", "data_type": "TYPE_FP32", "dims": [dims]},
                {"name": "OUTPUT1", "data_type": "TYPE_FP32", "dims": [dims]},
            ],
            **extra,
        },
    )
    save_torchscript(AddSub(), model_dir / "1" / "model.pt")
    return model_dir


def identity(repo: Path, name: str, data_type: str, dims: list[int], max_batch_size: int = 0) -> Path:
    model_dir = repo / name
    write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": max_batch_size,
            "input": [{"name": "IN", "data_type": data_type, "dims": dims}],
            "output": [{"name": "OUT", "data_type": data_type, "dims": dims}],
        },
    )
    save_torchscript(Identity(), model_dir / "1" / "model.pt")
    return model_dir


def python_model(
    repo: Path, name: str, body: str, config: dict[str, Any] | None = None, version: int = 1, **extra: Any
) -> Path:
    """A `backend: python` model whose `infer` body is given as source (inputs dict `inputs`)."""
    model_dir = repo / name
    write_config(
        model_dir,
        config
        or {
            "backend": "python",
            "max_batch_size": 0,
            "input": [{"name": "x", "data_type": "TYPE_FP32", "dims": [-1]}],
            "output": [{"name": "y", "data_type": "TYPE_FP32", "dims": [-1]}],
            **extra,
        },
    )
    source = textwrap.dedent(
        """
        import os, sys, time
        import torch


        class Model:
            def __init__(self, config, device):
                self.config = config
                self.device = device

            def infer(self, inputs):
        {body}
        """
    ).format(body=textwrap.indent(textwrap.dedent(body), " " * 8))
    (model_dir / str(version)).mkdir(parents=True, exist_ok=True)
    (model_dir / str(version) / "model.py").write_text(source)
    return model_dir


DTYPES = ["BOOL", "UINT8", "INT8", "INT16", "INT32", "INT64", "FP16", "BF16", "FP32", "FP64"]


class EchoAll(nn.Module):
    def forward(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
        e: torch.Tensor,
        f: torch.Tensor,
        g: torch.Tensor,
        h: torch.Tensor,
        i: torch.Tensor,
        j: torch.Tensor,
    ) -> list[torch.Tensor]:
        return [
            a.clone(),
            b.clone(),
            c.clone(),
            d.clone(),
            e.clone(),
            f.clone(),
            g.clone(),
            h.clone(),
            i.clone(),
            j.clone(),
        ]


class EchoTyped(nn.Module):
    def forward(
        self,
        a: torch.Tensor,
        b: torch.Tensor,
        c: torch.Tensor,
        d: torch.Tensor,
        e: torch.Tensor,
        f: torch.Tensor,
        g: torch.Tensor,
        h: torch.Tensor,
    ) -> list[torch.Tensor]:
        return [a.clone(), b.clone(), c.clone(), d.clone(), e.clone(), f.clone(), g.clone(), h.clone()]


# Datatypes that have a typed `contents` field in the protocol (FP16 and BF16 travel raw only).
TYPED_DTYPES = [t for t in DTYPES if t not in ("FP16", "BF16")]


def echo_all_types(repo: Path, name: str = "echo_all", typed_only: bool = False) -> Path:
    """One input and one output per supported datatype, each returned unchanged."""
    dtypes = TYPED_DTYPES if typed_only else DTYPES
    model_dir = repo / name
    write_config(
        model_dir,
        {
            "backend": "torchscript",
            "max_batch_size": 0,
            "input": [{"name": f"IN_{t}", "data_type": f"TYPE_{t}", "dims": [-1]} for t in dtypes],
            "output": [{"name": f"OUT_{t}", "data_type": f"TYPE_{t}", "dims": [-1]} for t in dtypes],
        },
    )
    save_torchscript(EchoTyped() if typed_only else EchoAll(), model_dir / "1" / "model.pt")
    return model_dir


def gated_model(repo: Path, gate: Path, name: str = "gated") -> Path:
    """A python model that blocks on a request of non-zero input until the test creates the file named by
    the input's first value (warm-up sends zeros), and announces that it started with `<file>.started`."""
    return python_model(
        repo,
        name,
        f"""
        x = inputs['x']
        if float(x.abs().sum()) != 0:
            gate = os.path.join({str(gate)!r}, str(int(x[0])))
            open(gate + '.started', 'w').close()
            while not os.path.exists(gate):
                time.sleep(0.01)
        return {{'y': x * 2}}
        """,
    )


# Triton's datatypes as numpy types, written out here (not derived from mpsd's table) to check it.
NUMPY_OF = {
    "BOOL": np.bool_,
    "UINT8": np.uint8,
    "INT8": np.int8,
    "INT16": np.int16,
    "INT32": np.int32,
    "INT64": np.int64,
    "FP16": np.float16,
    "FP32": np.float32,
    "FP64": np.float64,
}
