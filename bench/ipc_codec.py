"""Encode + decode of the per-request worker messages: pickle (what the worker channel used before) against
`mpsd.ipc.wire_codec`'s binary layout, with its caches warm (every request of a model at one batch size
after the first) and cold (a tail never seen: shapes that change from request to request).

Usage: python -m bench.ipc_codec [--number N] [--repeat R] [--out FILE.md]
Prints a Markdown table (microseconds per call, the best of R repeats of N calls each).
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path

from bench.cpus import cpu_name
from mpsd.ipc import protocol as p
from mpsd.ipc import wire_codec as w

MESSAGES: dict[str, object] = {
    "Infer, FP32[1,16] in, 1 out": p.Infer(
        123456,
        (p.TensorRef("INPUT0", "FP32", (1, 16), 64, 64),),
        ("OUTPUT0",),
        p.RegionRef("/mpsd-12345-a1b2c3d4", 1 << 20),
        p.RegionRef("/mpsd-12345-e5f6a7b8", 1 << 20),
        1,
        1_234_567_890_123_456,
        1,
    ),
    "InferDone, 1 out, CPU": p.InferDone(
        123456, (p.TensorRef("OUTPUT0", "FP32", (1, 16), 0, 64),), 12_000, 45_000, 8_000, 3_000, None
    ),
    "InferFailed": p.InferFailed(123456, "INTERNAL", "RuntimeError: shape mismatch"),
}


def per_call_us(fn: Callable[[], object], number: int, repeat: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def cold(fn: Callable[[], object]) -> Callable[[], object]:
    def call() -> object:
        w.clear_caches()
        return fn()

    return call


def measure(number: int, repeat: int) -> list[str]:
    clearing = per_call_us(cold(partial(int)), number, repeat)  # subtracted from the cold figures
    rows = [
        "| message | bytes: pickle / binary | pickle enc + dec | binary, warm: enc + dec | speed-up | "
        "binary, cold: enc + dec | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, msg in MESSAGES.items():
        pickled = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        binary = w.dumps(msg)
        assert binary[0] != w.PICKLED and w.loads(binary) == msg == pickle.loads(pickled)
        pe = per_call_us(partial(pickle.dumps, msg, protocol=pickle.HIGHEST_PROTOCOL), number, repeat)
        pd = per_call_us(partial(pickle.loads, pickled), number, repeat)
        we = per_call_us(partial(w.dumps, msg), number, repeat)
        wd = per_call_us(partial(w.loads, binary), number, repeat)
        ce = per_call_us(cold(partial(w.dumps, msg)), number, repeat) - clearing
        cd = per_call_us(cold(partial(w.loads, binary)), number, repeat) - clearing
        rows.append(
            f"| {name} | {len(pickled)} / {len(binary)} | {pe:.2f} + {pd:.2f} = {pe + pd:.2f} | "
            f"{we:.2f} + {wd:.2f} = {we + wd:.2f} | {(pe + pd) / (we + wd):.1f}x | "
            f"{ce:.2f} + {cd:.2f} = {ce + cd:.2f} | {(pe + pd) / (ce + cd):.1f}x |"
        )
    return rows


def machine() -> str:
    return f"{cpu_name()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--number", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows = measure(args.number, args.repeat)
    head = (
        f"Microseconds per call, best of {args.repeat} x {args.number}; {machine()}; "
        f"load average {load:.1f} at the start, {os.getloadavg()[0]:.1f} at the end."
    )
    text = "\n".join([head, "", *rows])
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
