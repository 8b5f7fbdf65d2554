"""The daemon's CPU per request for a front's ModelInfer calls, in one process, with nothing else running:
what the daemon's main thread pays for each call from the bytes a front sends to the reply it writes.

Each wave is `--batch` calls of one image each (ResNet-50's input, 3x224x224 FP16, in the front's arena),
with a header the daemon knows: the frames the front's own `CoreLink` writes are fed to the daemon's own
`FrontLink` through its protocol (as if read from the socket), and go through the daemon's own servicer,
pipeline, queue, lane and marshalling. Only the worker is a stand-in: a channel that takes the batch's
pieces in place (as a worker that mapped the arena does) and answers with 1000 FP16 logits per image, so
the Infer frame's encoding and the worker's messages (per batch, not per call) are not counted. The
figure is `time.process_time()` over the waves divided by the calls; `--profile` adds cProfile's top
functions.

    python -m bench.link_cost [--baseline-tree DIR] [--rounds 5] [--waves 300] [--profile]

With `--baseline-tree`, the same measurement runs on another tree (an export of mpsd/ with its generated
protobuf modules, as `bench.run --baseline-tree` takes it) in turns with this one, each in a fresh
interpreter.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
IMAGE = [3, 224, 224]  # each call's input, FP16 (`--small`: 16 values, as bench.run's small requests)
IMAGE_BYTES = 3 * 224 * 224 * 2
LOGITS_BYTES = 1000 * 2


class Transport:
    """Stands in for a socket: keeps what is written, and counts the daemon's replies."""

    def __init__(self) -> None:
        self.data = bytearray()

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.data += part

    def write(self, data: Any) -> None:
        self.data += data

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def _config(batch: int) -> Any:
    from mpsd.config.model_config import ModelConfig

    return ModelConfig.model_validate(
        {
            "max_batch_size": batch,
            "input": [{"name": "input", "data_type": "TYPE_FP16", "dims": IMAGE}],
            "output": [{"name": "logits", "data_type": "TYPE_FP16", "dims": [1000]}],
            "dynamic_batching": {"max_queue_delay_microseconds": 100_000, "preferred_batch_size": [batch]},
        }
    )


class Channel:
    """A worker that mapped the front's arena: it takes each image in place and answers with logits."""

    refusing = False
    overlaps = False
    label = "resnet50/1#0"
    pid = None

    def __init__(self, arena_id: int, rows: int, in_place: bool = True) -> None:
        from mpsd.daemon.dataplane.arenas import WorkerArenas

        self.arenas = WorkerArenas(lambda _: None)
        self.arenas.mapped = {arena_id}
        self.inputs = memoryview(bytearray(rows * IMAGE_BYTES))
        self.logits = memoryview(bytearray(rows * LOGITS_BYTES))
        self.in_place = in_place  # a front's images are in its arena; a gRPC call's are in its message
        self.executions = 0

    async def infer_batch(self, tensors: Any, timings: Any, *args: Any, **kwargs: Any) -> Any:
        from mpsd.ipc import protocol as p

        size = tensors.lay_out()
        if size > len(self.inputs):
            self.inputs = memoryview(bytearray(size))
        pieces = tensors.write(self.inputs, self.arenas.place)
        assert not self.in_place or len(pieces) == len(tensors.requests), "every image is taken in place"
        rows = sum(r.batch_size for r in tensors.requests)
        self.executions += 1
        await asyncio.sleep(0)  # the model's time
        ref = p.TensorRef("logits", "FP16", (rows, 1000), 0, rows * LOGITS_BYTES)
        return tensors.read((ref,), self.logits)


class Version:
    def __init__(self, plane: Any, config: Any) -> None:
        self.name, self.version, self.config, self.plane = "resnet50", 1, config, plane
        self.labels = None


class Registry:
    """One running model, `resnet50`, whose version's plane is the daemon's own."""

    def __init__(self, version: Version) -> None:
        self.version = version
        self.entries: dict[str, Any] = {}

    async def acquire(self, name: str, version: str, deadline: float | None) -> Version:
        return self.version

    def acquire_running(self, name: str, version: str) -> Version:
        return self.version

    def route(self, name: str, version: str) -> Version:
        return self.version

    def loads_first(self, name: str) -> bool:
        return False

    def touch(self, name: str) -> None:
        pass


def _request(rid: str) -> bytes:
    from mpsd.proto import grpc_service_pb2 as pb

    message = pb.ModelInferRequest(model_name="resnet50", id=rid)
    message.inputs.add(name="input", datatype="FP16", shape=[1, *IMAGE])
    message.raw_input_contents.append(bytes(IMAGE_BYTES))
    return bytes(message.SerializeToString())


def _link(servicer: Any, arena: Any) -> Any:
    """The daemon's end of a front's link, as this tree makes it."""
    from mpsd.daemon.supervise.fronts.link import FrontLink

    try:
        from mpsd.daemon.api.grpc.front_calls import front_calls, front_submit
    except ImportError:  # a tree before known calls were submitted where their frame is read
        from mpsd.daemon.api.grpc.trace import front_calls  # type: ignore[attr-defined,no-redef]

        return FrontLink(0, front_calls(servicer), lambda _: None, arena=arena)
    return FrontLink(0, front_calls(servicer), lambda _: None, arena=arena, submit=front_submit(servicer))


async def _measure(
    batch: int, waves: int, profile: bool, direct: bool = False, deadline_s: float | None = None
) -> dict[str, Any]:
    from mpsd.daemon.api.grpc.inference import InferenceServicer
    from mpsd.daemon.api.operations import Operations
    from mpsd.daemon.dataplane.arenas import ARENAS
    from mpsd.daemon.dataplane.plane import VersionPlane
    from mpsd.front.main import CoreLink
    from mpsd.ipc.shm import Region

    config = _config(batch)
    plane = VersionPlane("resnet50", 1, config)
    region = Region.create((batch + 1) * (IMAGE_BYTES + 8192))
    arena_id = ARENAS.add(region)
    channel = Channel(arena_id, batch, in_place=not direct)
    lane = plane.new_lane()
    plane.lanes = [lane]
    lane.attach(channel)
    plane.closed = None
    done_with = asyncio.Event()
    dispatcher = asyncio.create_task(lane.dispatch(channel, done_with))
    servicer = InferenceServicer(Operations(Registry(Version(plane, config)), lambda: False))
    link = _link(servicer, region)
    replies = Transport()
    link.attach(replies)
    protocol = link.protocol()

    front = CoreLink()
    front.attach_arena(region.name, region.size)
    sent = Transport()
    front.writer.transport = sent
    # No deadline by default, as the load generator's calls have none; `--deadline-s`: each call's.
    left = deadline_s if deadline_s is not None else -1.0
    frames = [front._infer_frame(call_id, left, _request(str(call_id))) for call_id in range(1, batch + 1)]
    for parts in frames:
        front.send(parts)
    await asyncio.sleep(0)
    first = bytes(sent.data)  # the key's declaration, then the calls
    sent.data.clear()
    for parts in frames[1:]:  # the same calls again: the key is declared once
        front.send(parts)
    front.send(frames[0])
    await asyncio.sleep(0)
    again = bytes(sent.data)

    def feed(data: bytes) -> None:
        view = memoryview(data)
        while view:
            buf = protocol.get_buffer(len(view))
            n = min(len(buf), len(view))
            buf[:n] = view[:n]
            protocol.buffer_updated(n)
            view = view[n:]

    requests = [_request(str(call_id)) for call_id in range(1, batch + 1)]

    async def wave(data: bytes) -> None:
        if direct:  # as gRPC's handler calls it where no front runs: a task per call, on its bytes
            calls = [servicer.infer_serialized_parts(request, None) for request in requests]
            await asyncio.gather(*calls)
            link.counts.served += batch
            return
        before = link.counts.served
        feed(data)
        while link.counts.served - before < batch:
            await asyncio.sleep(0)

    await wave(first)  # learns the header (the full path), then the rest are known
    for _ in range(20):
        await wave(again)
    # As the daemon does once its models are loaded (a tree before it did not): without it, the
    # collector's scans of what start-up made would be counted against every call.
    try:
        from mpsd.ipc.heap import settle_collector
    except ImportError:
        pass
    else:
        settle_collector()
    profiler = cProfile.Profile() if profile else None
    served, executions = link.counts.served, channel.executions
    started = time.process_time()
    if profiler is not None:
        profiler.enable()
    for _ in range(waves):
        await wave(again)
    if profiler is not None:
        profiler.disable()
    cpu = time.process_time() - started
    calls = link.counts.served - served
    result: dict[str, Any] = {
        "cpu_us_per_call": cpu / calls * 1e6,
        "calls": calls,
        "calls_per_execution": calls / (channel.executions - executions),
    }
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile"] = out.getvalue()
    done_with.set()
    await lane.stop()
    dispatcher.cancel()
    ARENAS.remove(arena_id)
    region.unlink()
    return result


def _one(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement in a fresh interpreter, on `tree`'s mpsd."""
    command = [sys.executable, "-m", "bench.link_cost", "--child", str(tree), "--batch", str(args.batch)]
    command += ["--waves", str(args.waves)] + (["--profile"] if args.profile else [])
    command += ["--direct"] if args.direct else []
    command += ["--small"] if args.small else []
    command += ["--deadline-s", str(args.deadline_s)] if args.deadline_s is not None else []
    done = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return dict(json.loads(done.stdout.splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="calls per wave, and the model's max batch")
    parser.add_argument("--waves", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--baseline-tree", type=Path)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--small", action="store_true", help="16 values a call instead of an image")
    parser.add_argument("--deadline-s", type=float, help="each front call's deadline (default: none)")
    parser.add_argument(
        "--direct", action="store_true", help="the calls as gRPC's handler makes them without fronts"
    )
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the tree to measure, in this process
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(args.child))  # its mpsd, not this tree's (nothing has imported mpsd yet)
        if args.small:
            global IMAGE, IMAGE_BYTES
            IMAGE, IMAGE_BYTES = [16], 32
        measured = _measure(args.batch, args.waves, args.profile, args.direct, args.deadline_s)
        print(json.dumps(asyncio.run(measured)))
        return
    trees = {"this tree": ROOT} | ({"baseline": args.baseline_tree.resolve()} if args.baseline_tree else {})
    got: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    for r in range(args.rounds):
        order = list(trees.items()) if r % 2 == 0 else list(reversed(trees.items()))
        for name, tree in order:
            got[name].append(_one(tree, args))
    for name, runs in got.items():
        us = [run["cpu_us_per_call"] for run in runs]
        print(
            f"{name}: {statistics.median(us):.1f} us of CPU per call, the least {min(us):.1f} "
            f"(rounds {', '.join(f'{u:.1f}' for u in us)}), "
            f"{runs[0]['calls_per_execution']:.1f} calls per execution"
        )
        if args.profile:
            print(runs[-1]["profile"])
    if args.baseline_tree:
        ratios = [a["cpu_us_per_call"] / b["cpu_us_per_call"] for a, b in zip(*got.values(), strict=True)]
        print(f"this tree / baseline, median of the rounds: x{statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
