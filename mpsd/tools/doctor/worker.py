"""A tiny model loaded in a real worker process on the device KIND_AUTO picks, with a memory fraction, and
answering one request: the daemon's own placement, worker launch, shared-memory channel and marshalling,
without a server or a port."""

from __future__ import annotations

import asyncio
import struct
import tempfile
import time
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

import structlog

from mpsd.tools.doctor.report import Check, failed, passed

NAME = "doctor_add_sub"
FRACTION = 0.25
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 10.0
A = (1.0, 2.0, 3.0, 4.0)
B = (0.5, 0.5, 0.5, 0.5)

CONFIG = f"""\
backend: torchscript
max_batch_size: 0
input:
  - {{name: INPUT0, data_type: TYPE_FP32, dims: [4]}}
  - {{name: INPUT1, data_type: TYPE_FP32, dims: [4]}}
output:
  - {{name: OUTPUT0, data_type: TYPE_FP32, dims: [4]}}
  - {{name: OUTPUT1, data_type: TYPE_FP32, dims: [4]}}
instance_group:
  - {{kind: KIND_AUTO, count: 1, memory_fraction: {FRACTION}}}
"""


def _write_model(repo: Path) -> Path:
    import torch

    from mpsd.examples import AddSub

    model_dir = repo / NAME
    (model_dir / "1").mkdir(parents=True)
    (model_dir / "config.yaml").write_text(CONFIG)
    torch.jit.save(torch.jit.script(AddSub()), str(model_dir / "1" / "model.pt"))
    return model_dir


class _Events:
    """The daemon's log events about the worker (its stderr lines among them), kept for a failure's detail
    instead of printed between the report's lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, logger: Any, method: str, event: MutableMapping[str, Any]) -> Mapping[str, Any]:
        self.lines.append(str(event.get("event", "")))
        raise structlog.DropEvent


def _floats(data: bytes) -> tuple[float, ...]:
    return struct.unpack(f"<{len(data) // 4}f", data)


async def _serve_once(model_dir: Path) -> tuple[dict[str, object], dict[str, tuple[float, ...]], int | None]:
    from mpsd.config.repository import load_model_source
    from mpsd.daemon.dataplane.marshal import BatchTensors
    from mpsd.daemon.dataplane.request import InferRequest, InputTensor, Timings
    from mpsd.daemon.supervise.launch import plan_version
    from mpsd.daemon.supervise.worker.handle import WorkerProcess

    source = load_model_source(model_dir)
    if not source.ok:
        raise RuntimeError(f"the test model did not load: {source.error}")
    _, launches = plan_version(source, 1)
    worker = WorkerProcess(launches[0])
    try:
        ready = await worker.start(START_TIMEOUT_S)
        inputs = tuple(
            InputTensor(name, "FP32", (4,), struct.pack("<4f", *values))
            for name, values in (("INPUT0", A), ("INPUT1", B))
        )
        request = InferRequest(NAME, "1", "doctor", inputs, ("OUTPUT0", "OUTPUT1"))
        results = await worker.channel.infer_batch(BatchTensors([request], []), Timings())
        outputs = {t.name: _floats(t.data) for t in results[0]}
        return ready.device, outputs, worker.pid
    finally:
        await worker.stop(STOP_TIMEOUT_S)


def worker_answers() -> Check:
    events = _Events()
    structlog.configure(processors=[events], cache_logger_on_first_use=False)
    started = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="mpsd-doctor-") as tmp:
            device, outputs, pid = asyncio.run(_serve_once(_write_model(Path(tmp))))
    except Exception as exc:
        said = "; ".join(line for line in events.lines[-5:] if line)
        return failed(
            "worker",
            f"{type(exc).__name__}: {exc}" + (f" (worker: {said})" if said else ""),
            "run `mpsd serve` and read the worker's log lines; see docs/troubleshooting.md",
        )
    wanted = {
        "OUTPUT0": tuple(a + b for a, b in zip(A, B, strict=True)),
        "OUTPUT1": tuple(a - b for a, b in zip(A, B, strict=True)),
    }
    fraction = device.get("memory_fraction")
    capped = f"memory_fraction {fraction}" if fraction is not None else "no memory_fraction on the CPU"
    where = f"pid {pid} on {device.get('kind')} ({device.get('name')}), {capped}"
    if outputs != wanted:
        return failed("worker", f"{where} answered {outputs}, expected {wanted}", "report this as a bug")
    seconds = time.perf_counter() - started
    return passed("worker", f"{where}: loaded a TorchScript model and answered a request ({seconds:.1f} s)")
