"""mpsd's extension of the statistics' JSON: the device's own compute time per execution, next to Triton's
host-side durations.

Triton's ModelStatistics message has no field for it (docs/api.md says why none is added), so gRPC carries
it in the admin service (ListWorkers) and the HTTP statistics as an extra key, which Triton's JSON readers
skip.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mpsd.daemon.dataplane.stats import VersionStats

DEVICE_COMPUTE_KEY = "mpsd_device_compute"


def with_device_compute(body: dict[str, Any], stats: Sequence[VersionStats]) -> dict[str, Any]:
    """Add `mpsd_device_compute` ({count: executions, ns}) to each version's `inference_stats` and to each
    batch size's entry that has device time (`stats` in the order of `body["model_stats"]`); left out
    where none was reported (the CPU)."""
    for entry, s in zip(body["model_stats"], stats, strict=True):
        if s.device_compute.count:
            total = {"count": s.device_compute.count, "ns": s.device_compute.ns}
            entry.setdefault("inference_stats", {})[DEVICE_COMPUTE_KEY] = total
        for batch in entry.get("batch_stats", []):
            sized = s.batches.get(int(batch["batch_size"]))
            if sized is not None and sized.device_compute.count:
                batch[DEVICE_COMPUTE_KEY] = {
                    "count": sized.device_compute.count,
                    "ns": sized.device_compute.ns,
                }
    return body
