"""`bench/trace_gpu.py` sums a torch.profiler trace's GPU time: what share of the span a kernel ran, the idle
gaps, and how much of the copies to the device ran under kernels. Synthetic traces with known answers."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from bench import trace_gpu


def kernel(ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "kernel", "name": "k", "ts": ts, "dur": dur}


def copy(ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur}


def test_busy_counts_overlapping_kernels_once_and_lists_the_long_gaps() -> None:
    # 0-100 and 50-150 overlap (150 us busy); a 40 us gap (too short to list); 190-290; a 210 us gap; 500-600
    kernels = [kernel(50, 100), kernel(0, 100), kernel(190, 100), kernel(500, 100)]
    span, covered, gaps = trace_gpu.busy(kernels)
    assert (span, covered, gaps) == (600, 350, [210])


def test_overlap_is_the_copy_time_under_kernels() -> None:
    kernels = [kernel(0, 100), kernel(200, 100)]
    copies = [copy(50, 100), copy(120, 20), copy(250, 100)]  # 50 under the first, none, 50 under the second
    assert trace_gpu.overlap(copies, kernels) == 100


def test_the_summary_reads_a_gzipped_trace_and_counts_graph_launches(tmp_path: Path, capsys: Any) -> None:
    events = [kernel(0, 100), kernel(100, 100), copy(10, 10)]
    launch = {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 1}
    events += [{**launch, "ts": t} for t in (0, 100)]
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    trace_gpu.summarize(path, None)
    out = capsys.readouterr().out
    assert "over 0.2 ms: the GPU ran one 100.0% of it" in out
    assert "kernel time per execution: 0.10 ms (2 executions)" in out
    assert "1 copies to the device, 0.01 ms, 0.01 ms of it under kernels" in out
