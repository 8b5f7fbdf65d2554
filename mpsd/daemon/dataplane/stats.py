"""Per-version inference statistics with Triton's meaning of each counter."""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

# Upper bounds, in seconds, of the device-time histogram's buckets (Prometheus `le`); +Inf follows.
DEVICE_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
# Upper bounds, in seconds, of the buckets of successful requests' end-to-end time (1-2-5 steps); +Inf
# follows. Their quantiles (p50, p99) are estimated within a bucket, as Prometheus' histogram_quantile does.
LATENCY_BUCKETS_S = (
    0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
    10.0, 20.0, 60.0,
)  # fmt: skip
# The same bounds in nanoseconds: a request's time is placed with one bisect of integers, no division.
_LATENCY_BOUNDS_NS = tuple(round(b * 1e9) for b in LATENCY_BUCKETS_S)


def cumulative_buckets(bounds: tuple[float, ...], counts: list[int]) -> list[tuple[str, int]]:
    """Prometheus' buckets from per-bucket counts: (upper bound, observations at or below it), ending with
    +Inf."""
    out, total = [], 0
    for bound, n in zip((*map(str, bounds), "+Inf"), counts, strict=True):
        total += n
        out.append((bound, total))
    return out


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns


@dataclass
class DeviceTime:
    """The device's own compute time per execution (timing events in the worker, CUDA and MPS): a count
    of executions, their total, and how many fell in each bucket of DEVICE_BUCKETS_S (the last: above
    them all). Executions on the CPU have none and are not counted: count 0 means none was reported."""

    count: int = 0
    ns: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(DEVICE_BUCKETS_S) + 1))

    def add(self, ns: int) -> None:
        self.count += 1
        self.ns += ns
        self.buckets[bisect.bisect_left(DEVICE_BUCKETS_S, ns / 1e9)] += 1

    def cumulative(self) -> list[tuple[str, int]]:
        """Prometheus' buckets: (upper bound, executions at or below it), ending with +Inf."""
        return cumulative_buckets(DEVICE_BUCKETS_S, self.buckets)


@dataclass
class BatchStats:
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    device_compute: Duration = field(default_factory=Duration)  # per execution; count 0: none reported


@dataclass
class VersionStats:
    """Counters for one model version; updated on the event loop, so no locking is needed."""

    inference_count: int = 0
    execution_count: int = 0
    responses: int = 0  # responses sent: one per request, or each of a decoupled model's
    last_inference_ms: int = 0
    success: Duration = field(default_factory=Duration)
    # successful requests by end-to-end time, in the buckets of LATENCY_BUCKETS_S (the last: above them);
    # their count and sum are `success`'s: whatever adds to `success` counts a bucket too
    latency_buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    device_compute: DeviceTime = field(default_factory=DeviceTime)
    # Response cache lookups (Triton's cache_hit / cache_miss): a hit is a success without an inference.
    cache_hit: Duration = field(default_factory=Duration)
    cache_miss: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    failures_by_reason: dict[str, int] = field(default_factory=dict)

    def record_success(self, total_ns: int, batch_size: int, responses: int = 1) -> None:
        """A request answered in full: with one response, or a decoupled model's `responses`."""
        self.success.add(total_ns)
        self.latency_buckets[bisect.bisect_left(_LATENCY_BOUNDS_NS, total_ns)] += 1
        self.inference_count += batch_size
        self.responses += responses
        self.last_inference_ms = int(time.time() * 1000)

    def record_cache_hit(self, lookup_ns: int, total_ns: int) -> None:
        """A request answered from the response cache: a success, not an inference or an execution (as
        Triton counts it)."""
        self.cache_hit.add(lookup_ns)
        self.success.add(total_ns)
        self.latency_buckets[bisect.bisect_left(_LATENCY_BOUNDS_NS, total_ns)] += 1
        self.responses += 1
        self.last_inference_ms = int(time.time() * 1000)

    def record_failure(self, total_ns: int, reason: str) -> None:
        """`reason` is the error code's name (e.g. RESOURCE_EXHAUSTED), a small fixed set for metrics."""
        self.fail.add(total_ns)
        self.failures_by_reason[reason] = self.failures_by_reason.get(reason, 0) + 1
        self.last_inference_ms = int(time.time() * 1000)

    def record_execution(
        self,
        batch_size: int,
        input_ns: int,
        infer_ns: int,
        output_ns: int,
        requests: int,
        device_ns: int | None = None,
    ) -> None:
        """One model execution that served `requests` requests with `batch_size` rows in total;
        `device_ns` is the device's own time for it (None on the CPU)."""
        self.execution_count += 1
        self.compute_input.add(input_ns, requests)
        self.compute_infer.add(infer_ns, requests)
        self.compute_output.add(output_ns, requests)
        b = self.batches.setdefault(batch_size, BatchStats())
        b.compute_input.add(input_ns)
        b.compute_infer.add(infer_ns)
        b.compute_output.add(output_ns)
        if device_ns is not None:
            self.device_compute.add(device_ns)
            b.device_compute.add(device_ns)
