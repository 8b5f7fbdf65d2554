"""Where a small request's time goes: py-spy on mpsd's daemon and worker during scenarios 1 and 2.

`python -m bench.profile_small --out bench/results --name small-request-profile-cpu` starts mpsd (no front
processes by default) with the 16-float identity of scenarios 1 and 2, and for each scenario runs the same
closed-loop load as `bench.run` (one client; then 16 in flight) for `--seconds` while py-spy samples the
daemon and the worker (on-CPU samples, every thread, `--nonblocking`). It writes the raw profiles
(`<name>-s<N>-{daemon,worker}.txt`) and `<name>.json`: per process the CPU time per request (psutil) and
the share of the main thread's busy samples by function (own and inclusive) and by part of the path (the
innermost mpsd module on the stack, or the library the leaf is in when no mpsd frame is).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import common, profile
from bench.loadgen import ClientPool
from bench.run import RESULTS, measure

PLANS = {"1": 1, "2": 16}  # scenario -> requests in flight (one client process)


# What a busy sample of the main thread was doing, by the first rule whose frame (a substring of
# `function (path:line)`) is on its stack, checked in this order; "other" when none is.
DAEMON_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("logging", ("structlog", "/logging/", "mpsd/logs/")),
    ("send to the worker: the socket write (and the worker's wake-up)", ("_SelectorSocketTransport.write",)),
    ("pickle a control message", ("encode (mpsd/ipc/framing.py",)),
    ("receive from the worker: read, unpickle, settle the future", ("_SelectorSocketTransport._read_ready",)),
    ("statistics", ("mpsd/daemon/dataplane/stats.py",)),
    ("handler: decode, validate, respond (mpsd/daemon/api)", ("mpsd/daemon/api/",)),
    (
        "hand-offs: queue, batcher, instance, worker channel (mpsd/daemon/core, supervise)",
        ("mpsd/daemon/core/", "mpsd/daemon/supervise/"),
    ),
]
WORKER_CATEGORIES: list[tuple[str, tuple[str, ...]]] = [
    ("logging", ("structlog", "/logging/", "mpsd/logs/")),
    ("send the answer: socket write (and the daemon's wake-up)", ("send_blocking (mpsd/ipc/framing.py",)),
    ("pickle the answer", ("encode (mpsd/ipc/framing.py",)),
    ("receive: read, unpickle (and wake-up)", ("FrameReader.", "recv_blocking")),
    ("model call", ("mpsd/worker/backends/",)),
    (
        "inputs and outputs: map shared memory, write outputs",
        ("mpsd/worker/inference.py", "mpsd/worker/regions.py"),
    ),
    ("request loop, message objects", ("mpsd/worker/main.py",)),
]


def category(frames: list[str], rules: list[tuple[str, tuple[str, ...]]]) -> str:
    for label, needles in rules:
        if any(needle in frame for frame in frames for needle in needles):
            return label
    leaf = frames[-1]
    if leaf.startswith("Handle._run ("):
        return "C code run by the event loop: gRPC's callbacks, C task steps (no Python frame below)"
    if any(lib in leaf for lib in ("asyncio/", "selectors.py", "contextvars")):
        return "event loop in Python: select, ready queue, futures, tasks, events"
    return "other"


def part(frames: list[str]) -> str:
    """The innermost mpsd module on the stack (`mpsd/daemon/api/parse.py`), with the leaf's library when
    the leaf is outside mpsd (`mpsd/ipc/framing.py > pickle`), or the leaf's library alone."""
    leaf = frames[-1]
    where = leaf.partition(" (")[2].rpartition(":")[0]
    lib = "mpsd" if "mpsd/" in where else _library(where)
    for frame in reversed(frames):
        path = frame.partition(" (")[2].rpartition(":")[0]
        if "mpsd/" in path:
            module = "mpsd/" + path.split("mpsd/", 1)[1]
            return module if lib == "mpsd" else f"{module} > {lib}"
    return lib


def _library(path: str) -> str:
    for marker in ("site-packages/", "python3.11/", "python3.12/", "python3.10/", "python3.13/"):
        if marker in path:
            rest = path.split(marker, 1)[1]
            return rest.split("/", 1)[0].removesuffix(".py")
    return path.rsplit("/", 1)[-1].removesuffix(".py") or path


def breakdown(path: Path, rules: list[tuple[str, tuple[str, ...]]]) -> dict[str, Any]:
    """Busy samples of the main thread by category and by part of the path (percent of busy samples)."""
    parts: collections.Counter[str] = collections.Counter()
    categories: collections.Counter[str] = collections.Counter()
    busy = total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if not frames[0].startswith(("_run_module_as_main", "<module>")):
            continue
        n = int(count)
        total += n
        if profile._idle(frames[-1]):
            continue
        busy += n
        parts[part(frames)] += n
        categories[category(frames, rules)] += n
    return {
        "by_category": [(c, n, round(100.0 * n / busy, 1)) for c, n in categories.most_common()]
        if busy
        else [],
        "main_thread_samples": total,
        "busy_samples": busy,
        "by_part": [(p, round(100.0 * n / busy, 1)) for p, n in parts.most_common(30)] if busy else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="profiled seconds per scenario")
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--front-processes", default="0", help="mpsd's front_processes (default 0)")
    parser.add_argument("--only", default="1,2")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--name", default="small-request-profile-cpu")
    parser.add_argument(
        "--native",
        action="store_true",
        help="py-spy --native (C and Cython frames too; pauses the processes to sample, so slower; it "
        "samples idle threads too, so the JSON's shares are not busy shares: read the raw profiles)",
    )
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    args = parser.parse_args()
    profile.EXTRA[:] = ["--native"] if args.native else ["--nonblocking"]
    profile.RATE = args.rate
    args.out.mkdir(parents=True, exist_ok=True)
    from bench.models import Identity, identity_config, write_model

    work = Path(tempfile.mkdtemp(prefix="mpsd-profile-"))
    results: dict[str, Any] = {
        "machine": common.machine_info(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "scenarios": {},
    }
    pool = ClientPool(1)
    try:
        write_model(work / "repo", "identity_16", Identity(), identity_config([1, 16], batching=True))
        mpsd = common.start_mpsd(work / "repo", work, front_processes=args.front_processes)
        try:
            print(f"mpsd ready in {mpsd.wait_ready():.1f} s", flush=True)
            request = common.infer_request("identity_16", [1, 16])
            worker = profile.worker_pid(mpsd.log_path, "identity_16")
            for key in args.only.split(","):
                concurrency = PLANS[key]
                load_before = os.getloadavg()[0]
                stem = args.out / f"{args.name}-s{key}"
                targets = common.profile_targets(mpsd.pid, worker)
                with profile.PySpy(stem, targets, args.seconds + args.warmup + 1.0) as spy:
                    time.sleep(0.5)  # py-spy attaches
                    figures = measure(pool, mpsd, request, concurrency, 1, args.seconds, args.warmup)
                entry: dict[str, Any] = {
                    "concurrency": concurrency,
                    "load_average_1m": [load_before, os.getloadavg()[0]],
                    "figures": figures,
                    "profiles": {},
                }
                for proc, summary in spy.summaries(top=15).items():
                    rules = WORKER_CATEGORIES if proc == "worker" else DAEMON_CATEGORIES
                    entry["profiles"][proc] = summary | breakdown(spy.paths[proc], rules)
                    # Samples per request: the load ran for warm-up + seconds at about this throughput.
                    requests = figures["throughput_rps"] * (args.seconds + args.warmup)
                    entry["profiles"][proc]["us_per_request_by_category"] = [
                        (label, round(n / profile.RATE / requests * 1e6, 1))
                        for label, n, _ in entry["profiles"][proc]["by_category"]
                    ]
                results["scenarios"][key] = entry
                cpu = figures["cpu_us_per_request"]
                print(
                    f"scenario {key}: {figures['throughput_rps']:.0f} req/s, p50 {figures['p50_ms']:.3f} ms, "
                    f"CPU us/request daemon {cpu['server']:.0f}, worker {cpu['workers']:.0f}",
                    flush=True,
                )
                for proc, prof in entry["profiles"].items():
                    print(
                        f"  {proc}: busy {100 * prof['busy_share']:.0f}% of the main thread's samples",
                        flush=True,
                    )
                    for (label, _, share), (_, us) in zip(
                        prof["by_category"], prof["us_per_request_by_category"], strict=True
                    ):
                        print(f"    {share:5.1f}%  ~{us:5.0f} us/request  {label}", flush=True)
        finally:
            mpsd.stop()
    finally:
        pool.close()
        shutil.rmtree(work, ignore_errors=True)
    out = args.out / f"{args.name}.json"
    out.write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"written: {out}")


if __name__ == "__main__":
    main()
