"""The benchmark's models and the repositories that serve them (written to a temporary directory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import yaml
from torch import nn


class Identity(nn.Module):
    """Returns a copy of its input: the model costs next to nothing, so the serving path is what is timed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clone()


class SmallCNN(nn.Module):
    """Three conv blocks and a linear head on 3x64x64 images: about 82 MFLOP per image."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(64, 128, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x).flatten(1))
        return out


CNN_IMAGE = (3, 64, 64)
CNN_MAX_BATCH = 32


def write_model(repo: Path, name: str, module: nn.Module, config: dict[str, Any]) -> Path:
    """`repo/name/config.yaml` plus `repo/name/1/model.pt` (TorchScript)."""
    model_dir = repo / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.yaml").write_text(yaml.safe_dump({"name": name, **config}, sort_keys=False))
    torch.jit.save(torch.jit.script(module.eval()), str(model_dir / "1" / "model.pt"))
    return model_dir


IDENTITY_MAX_BATCH = 16


def identity_config(dims: list[int], batching: bool = False) -> dict[str, Any]:
    """With `batching`, the first of `dims` is the batch dimension (up to IDENTITY_MAX_BATCH rows) and
    dynamic batching runs with no queue delay: a request that finds the worker idle runs at once, and
    requests that arrive while it is busy run together next.

    One intra-op thread: the identity stands for a model that costs nothing, so its copy must not wake a
    thread team per CPU. With torch's default on a 16-CPU host, each 600 KB copy left 16 OpenMP threads
    spinning, about 90 ms of CPU per request taken from the daemon, the fronts and the clients."""
    config: dict[str, Any] = {
        "backend": "torchscript",
        "max_batch_size": IDENTITY_MAX_BATCH if batching else 0,
        "input": [{"name": "INPUT", "data_type": "TYPE_FP32", "dims": dims[1:] if batching else dims}],
        "output": [{"name": "OUTPUT", "data_type": "TYPE_FP32", "dims": dims[1:] if batching else dims}],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
        "parameters": {"intra_op_thread_count": "1"},
    }
    if batching:
        config["dynamic_batching"] = {"max_queue_delay_microseconds": 0}
    return config


# The identity models of scenarios 1-3: name -> (shape of one request, dynamic batching). The Triton peer
# serves the same ones (bench/triton_peer.py).
OVERHEAD_IDENTITIES = {"identity_16": ([1, 16], True), "identity_600k": ([1, 3, 224, 224], False)}


def cnn_config(batching: bool, delay_us: int, threads: int | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {
        "backend": "torchscript",
        "max_batch_size": CNN_MAX_BATCH,
        "input": [{"name": "image", "data_type": "TYPE_FP32", "dims": list(CNN_IMAGE)}],
        "output": [{"name": "logits", "data_type": "TYPE_FP32", "dims": [10]}],
        "instance_group": [{"kind": "KIND_CPU", "count": 1}],
    }
    if batching:
        config["dynamic_batching"] = {
            "max_queue_delay_microseconds": delay_us,
            "preferred_batch_size": [CNN_MAX_BATCH],
        }
    if threads:
        config["parameters"] = {"intra_op_thread_count": str(threads)}
    return config


def build_overhead_repo(repo: Path, cnn_delay_us: int, cnn_threads: int | None = None) -> None:
    """Models of scenarios 1-4: two identities (16 floats, 600 KB) and the CNN with and without batching
    (on `cnn_threads` CPU threads when given)."""
    for name, (shape, batching) in OVERHEAD_IDENTITIES.items():
        write_model(repo, name, Identity(), identity_config(shape, batching))
    torch.manual_seed(0)
    cnn = SmallCNN()
    write_model(repo, "cnn_batched", cnn, cnn_config(True, cnn_delay_us, cnn_threads))
    write_model(repo, "cnn_unbatched", cnn, cnn_config(False, 0, cnn_threads))


def build_startup_repo(repo: Path, models: int) -> None:
    """`models` copies of the small identity model, for start-up time and memory per model."""
    for i in range(models):
        write_model(repo, f"identity_{i}", Identity(), identity_config([1, 16]))


class Bottleneck(nn.Module):
    """ResNet-50's block as torchvision builds it (stride on the 3x3 conv, "ResNet v1.5")."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        width, out = planes, planes * 4
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample: nn.Module = nn.Identity()
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        out: torch.Tensor = self.relu(y + self.downsample(x))
        return out


class ResNet50(nn.Module):
    """ResNet-50 (torchvision's layout, random weights) without torchvision, for machines that lack it;
    `width` scales every layer's channels (64: the real model, about 4.1 GFLOP per 224x224 image; 8: a
    stand-in cheap enough for a CPU)."""

    def __init__(self, width: int = 64, classes: int = 1000) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        blocks: list[nn.Module] = []
        inplanes = width
        for i, count in enumerate((3, 4, 6, 3)):
            planes = width * 2**i
            for j in range(count):
                blocks.append(Bottleneck(inplanes, planes, stride=2 if i > 0 and j == 0 else 1))
                inplanes = planes * 4
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.fc(self.blocks(self.stem(x)).mean((2, 3)))
        return out


class Encoder(nn.Module):
    """A BERT-like text encoder (torch.nn.TransformerEncoder, random weights): token ids in, the mean of the
    last layer over the real positions out. `mask` (1 real, 0 padding) is what shape buckets make; without
    it every position is real, so one module serves with buckets and without."""

    def __init__(
        self, layers: int = 6, d_model: int = 512, heads: int = 8, vocab: int = 8192, max_len: int = 512
    ):
        super().__init__()
        self.tokens = nn.Embedding(vocab, d_model)
        self.positions = nn.Embedding(max_len, d_model)
        layer = nn.TransformerEncoderLayer(d_model, heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
        x = self.tokens(ids) + self.positions(positions)
        if mask is None:
            weights = torch.ones(ids.shape, dtype=x.dtype, device=ids.device)
            hidden = self.encoder(x)
        else:
            weights = mask.to(x.dtype)
            hidden = self.encoder(x, src_key_padding_mask=mask == 0)
        summed = (hidden * weights.unsqueeze(-1)).sum(1)
        out: torch.Tensor = summed / weights.sum(1, keepdim=True)
        return out
