"""Example Python model for mpsd: y = x * factor."""

import torch


class Model:
    def __init__(self, config: dict, device: torch.device) -> None:
        self.factor = float(config["parameters"].get("factor", "1"))
        self.device = device

    def infer(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"y": inputs["x"] * self.factor}
