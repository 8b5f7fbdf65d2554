"""Builds the weights of the example repository (`make run` calls this); nothing is downloaded."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn


class AddSub(nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a + b, a - b


class TinyCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.features(x).flatten(1))
        return out


def build(repo: Path) -> None:
    torch.manual_seed(0)
    for model in ("add_sub", "tiny_cnn"):
        (repo / model / "1").mkdir(parents=True, exist_ok=True)  # git keeps no empty version folders
    torch.jit.save(torch.jit.script(AddSub()), str(repo / "add_sub" / "1" / "model.pt"))
    cnn = TinyCNN().eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    program = torch.export.export(cnn, (torch.zeros(2, 3, 32, 32),), dynamic_shapes=({0: batch},))
    torch.export.save(program, str(repo / "tiny_cnn" / "1" / "model.pt2"))


def main() -> int:
    repo = Path(sys.argv[1] if len(sys.argv) > 1 else "config/models")
    build(repo)
    print(f"example models written under {repo}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
