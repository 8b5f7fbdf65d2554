"""Per-version inference statistics with Triton's meaning of each counter."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass
class VersionStats:
    """Counters for one model version; updated on the event loop, so no locking is needed."""

    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    failures_by_reason: dict[str, int] = field(default_factory=dict)

    def record_success(self, total_ns: int, batch_size: int) -> None:
        self.success.add(total_ns)
        self.inference_count += batch_size
        self.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, total_ns: int, reason: str) -> None:
        """`reason` is the error code's name (e.g. RESOURCE_EXHAUSTED), a small fixed set for metrics."""
        self.fail.add(total_ns)
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1
        self.last_inference_ms = int(time.time() * 1000)

    def record_execution(
        self, batch_size: int, input_ns: int, infer_ns: int, output_ns: int, requests: int
    ) -> None:
        """One model execution that served `requests` requests with `batch_size` rows in total."""
        self.execution_count += 1
        self.compute_input.add(input_ns, requests)
        self.compute_infer.add(infer_ns, requests)
        self.compute_output.add(output_ns, requests)
        b = self.batches.setdefault(batch_size, BatchStats())
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
