"""What the request-latency histogram adds to each successful request: `VersionStats.record_success` as it
is, against the same method without the histogram's bucket (one bisect over 20 integers and an increment),
timed in turns in one process; the fastest of many rounds of each, in nanoseconds per call.

    python -m bench.stats_cost [--rounds 40] [--calls 200000]

Standard library only: it runs with any Python 3.10+, no virtual environment needed.
"""

from __future__ import annotations

import argparse
import platform
import time
import timeit

from mpsd.daemon.dataplane.stats import VersionStats

# Request times spread over the histogram's range, from 80 µs to 2 s.
TIMES_NS = (80_000, 450_000, 1_200_000, 7_000_000, 60_000_000, 2_000_000_000)


class WithoutHistogram(VersionStats):
    """record_success as it was before the latency buckets."""

    def record_success(self, total_ns: int, batch_size: int, responses: int = 1) -> None:
        self.success.add(total_ns)
        self.inference_count += batch_size
        self.responses += responses
        self.last_inference_ms = int(time.time() * 1000)


def per_call_ns(stats: VersionStats, calls: int) -> float:
    record = stats.record_success
    times = TIMES_NS
    n = len(times)

    def run() -> None:
        for i in range(calls):
            record(times[i % n], 1)

    return timeit.timeit(run, number=1) / calls * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--calls", type=int, default=200_000)
    args = parser.parse_args()
    best = {"with": float("inf"), "without": float("inf")}
    for _ in range(args.rounds):
        best["without"] = min(best["without"], per_call_ns(WithoutHistogram(), args.calls))
        best["with"] = min(best["with"], per_call_ns(VersionStats(), args.calls))
    print(f"python {platform.python_version()} on {platform.machine()} ({platform.processor() or 'cpu'})")
    print(f"record_success without the histogram: {best['without']:.1f} ns per call")
    print(f"record_success with the histogram:    {best['with']:.1f} ns per call")
    print(f"added per successful request:         {best['with'] - best['without']:.1f} ns")


if __name__ == "__main__":
    main()
