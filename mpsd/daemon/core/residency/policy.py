"""A model's residency settings: its own config's `residency` over the daemon's defaults."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mpsd.config.daemon_config import ResidencyDefaults
from mpsd.config.model_config import ModelConfig


@dataclass(frozen=True)
class Policy:
    load: Literal["startup", "on_demand"]
    keep_alive_s: float | None  # None: never unloaded for being idle
    pinned: bool
    footprint_bytes: int | None  # declared, per instance

    def describe_keep_alive(self) -> str:
        return "never" if self.keep_alive_s is None else f"{self.keep_alive_s:g} s"


def policy_of(config: ModelConfig | None, defaults: ResidencyDefaults) -> Policy:
    own = config.residency if config is not None else None
    load = (own.load if own is not None else None) or defaults.load
    keep = own.keep_alive_s if own is not None and own.keep_alive_s is not None else defaults.keep_alive_s
    pinned = own.pinned if own is not None and own.pinned is not None else defaults.pinned
    footprint = own.footprint_bytes if own is not None else None
    return Policy(load, None if keep == "never" else float(keep), pinned, footprint)
