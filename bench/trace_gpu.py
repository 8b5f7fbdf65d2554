"""How busy the GPU was in a torch.profiler Chrome trace (`mpsd profile` on CUDA): kernel time against the
span, the idle gaps between kernels, and the copies to the device and how much of them ran under kernels.

nvidia-smi's busy figure is a coarse sample; the trace has every kernel and copy with its own timing.

    python -m bench.trace_gpu bench/results/resnet50-h100-worker-trace.json.gz
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from pathlib import Path
from typing import Any

GAP_US = 100  # idle stretches at least this long are listed


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events: list[dict[str, Any]] = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X"]


def busy(kernels: list[dict[str, Any]]) -> tuple[float, float, list[float]]:
    """The kernels' span and the time at least one ran (us), and the idle gaps of at least GAP_US."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    start, end = kernels[0]["ts"], kernels[0]["ts"]
    covered, gaps = 0.0, []
    for e in kernels:
        s, f = e["ts"], e["ts"] + e["dur"]
        if s - end >= GAP_US:
            gaps.append(s - end)
        covered += max(0.0, f - max(s, end))
        end = max(end, f)
    return end - start, covered, sorted(gaps, reverse=True)


def overlap(copies: list[dict[str, Any]], kernels: list[dict[str, Any]]) -> float:
    """Time (us) during which a copy and a kernel ran together."""
    kernels = sorted(kernels, key=lambda e: e["ts"])
    starts = [e["ts"] for e in kernels]
    total = 0.0
    for c in copies:
        s, f = c["ts"], c["ts"] + c["dur"]
        i = max(0, bisect.bisect_left(starts, s) - 1)
        for e in kernels[i:]:
            if e["ts"] > f:
                break
            total += max(0.0, min(f, e["ts"] + e["dur"]) - max(s, e["ts"]))
    return total


def summarize(path: Path, executions: int | None) -> None:
    """Print the trace's GPU time (see the module's docstring)."""
    events = load(path)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    to_device = [e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e["name"]]
    span, covered, gaps = busy(kernels)
    share = covered / span * 100
    print(f"{len(kernels)} kernels over {span / 1e3:.1f} ms: the GPU ran one {share:.1f}% of it")
    print(f"idle gaps of {GAP_US} us or more: {len(gaps)}, {sum(gaps) / 1e3:.2f} ms in all")
    # With CUDA graphs each execution is one graph launch; the window's own count can miss one that was
    # already on the device when it started.
    launches = sum(1 for e in events if "GraphLaunch" in e.get("name", ""))
    executions = launches or executions
    if executions:
        kernel_ms = sum(e["dur"] for e in kernels) / 1e3
        print(f"kernel time per execution: {kernel_ms / executions:.2f} ms ({executions} executions)")
    copied = sum(c["dur"] for c in to_device)
    print(
        f"{len(to_device)} copies to the device, {copied / 1e3:.2f} ms, "
        f"{overlap(to_device, kernels) / 1e3:.2f} ms of it under kernels"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument(
        "--executions", type=int, help="executions in the window, without CUDA graphs (`mpsd profile` says)"
    )
    args = parser.parse_args()
    summarize(args.trace, args.executions)


if __name__ == "__main__":
    main()
