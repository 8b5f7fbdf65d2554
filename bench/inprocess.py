"""The model called in-process: what serving adds is measured against this.

Timing runs in helper processes (`python -m bench.inprocess`), each with its own OpenMP settings: one with
the environment as given (torch's defaults unless set) and, where mpsd's workers change them (a short
OpenMP spin on machines of at most 4 CPUs, see `mpsd/worker/main.py`), one with the workers' settings. The
in-process reference is the faster of the two at each batch size, so the comparison never rests on a
setting that happens to suit mpsd.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")


def worker_openmp_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment an mpsd worker gives torch: on machines of at most 4 CPUs it bounds OpenMP spinning
    unless a policy is set (`_bound_openmp_spinning` in mpsd/worker/main.py)."""
    from mpsd.osfacts import usable_cpus
    from mpsd.worker.main import SMALL_MACHINE_CPUS

    out = dict(env)
    if "OMP_WAIT_POLICY" not in out and usable_cpus() <= SMALL_MACHINE_CPUS:
        out.setdefault("GOMP_SPINCOUNT", "10000")
        out.setdefault("KMP_BLOCKTIME", "1")
    return out


# ---- in the helper process -------------------------------------------------------------------------------


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(
    fn: Callable[[], object], duration_s: float, device: Any, warmup: int = 5, min_calls: int = 5
) -> list[int]:
    """Latencies (ns) of back-to-back calls for about `duration_s` seconds (at least `min_calls`)."""
    import torch

    with torch.inference_mode():
        for _ in range(warmup):
            fn()
        _sync(device)
        lat: list[int] = []
        stop_at = time.perf_counter_ns() + int(duration_s * 1e9)
        while True:
            t0 = time.perf_counter_ns()
            if t0 >= stop_at and len(lat) >= min_calls:
                break
            fn()
            _sync(device)
            lat.append(time.perf_counter_ns() - t0)
    return lat


def _graphed_call(module: Any, host: Any, dev: Any, host_to_host: bool) -> Callable[[], object]:
    """One call of `module` on `host`'s shape as a replayed CUDA graph, recorded the usual way (warm-up
    calls on a side stream, then one recorded call on static tensors). Host to host, the batch is copied
    from page-locked memory straight into the graph's input, as mpsd's worker does."""
    import torch

    static = host.to(dev)
    pinned = host.pin_memory()
    with torch.inference_mode():
        side = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(3):
                module(static)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            result = module(static)

    def call() -> object:
        if host_to_host:
            static.copy_(pinned, non_blocking=True)
            graph.replay()
            return result.to("cpu")
        graph.replay()
        return result

    return call


class _Runner:
    def __init__(self) -> None:
        import torch

        torch.set_grad_enabled(False)
        self._modules: dict[tuple[str, str], Any] = {}

    def module(self, path: str, device: str) -> Any:
        import torch

        key = (path, device)
        if key not in self._modules:
            module = torch.jit.load(path, map_location=device)  # type: ignore[no-untyped-call]
            module.eval()
            self._modules[key] = module
        return self._modules[key]

    def latency(self, path: str, shape: list[int], duration_s: float) -> list[int]:
        """Latencies of one call on a CPU tensor of `shape` (float32)."""
        import torch

        module = self.module(path, "cpu")
        x = torch.randn(shape)
        return time_calls(lambda: module(x), duration_s, torch.device("cpu"), warmup=20)

    def batch_seconds(
        self,
        path: str,
        image: list[int],
        sizes: list[int],
        dtype: str,
        device: str,
        duration_s: float,
        host_to_host: bool,
        graphs: bool = False,
    ) -> dict[int, float]:
        """Median seconds of one call at each batch size. With `host_to_host`, the batch starts in host
        memory and the output ends there; otherwise both stay on the device. With `graphs` (CUDA), the
        model is recorded as a CUDA graph at each batch size and replayed."""
        import torch

        dev = torch.device(device)
        module = self.module(path, device)
        gen = torch.Generator().manual_seed(0)
        out: dict[int, float] = {}
        for size in sorted(sizes):
            host = torch.randn((size, *image), generator=gen).to(getattr(torch, dtype))
            x = host if host_to_host else host.to(dev)
            call: Callable[[], object]
            if graphs:
                call = _graphed_call(module, host, dev, host_to_host)
            else:

                def call(x: torch.Tensor = x) -> object:
                    if host_to_host:
                        return module(x.to(dev)).to("cpu")
                    return module(x)

            lat = sorted(time_calls(call, duration_s, dev))
            out[size] = lat[len(lat) // 2] / 1e9
        return out


def _serve(conn: Connection) -> None:
    runner = _Runner()
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        method, kwargs = msg
        try:
            conn.send(("ok", getattr(runner, method)(**kwargs)))
        except Exception as exc:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


# ---- in the benchmark process -----------------------------------------------------------------------------


class Helper:
    """A timing process with the given environment; calls are answered in order."""

    def __init__(self, label: str, env: Mapping[str, str]) -> None:
        self.label = label
        parent, child = socket.socketpair()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "bench.inprocess", "--fd", str(child.fileno())],
            pass_fds=(child.fileno(),),
            cwd=ROOT,
            env=dict(env),
            stdin=subprocess.DEVNULL,
        )
        child.close()
        self._conn = Connection(parent.detach())
        self.pid = self._proc.pid

    def call(self, method: str, **kwargs: Any) -> Any:
        self._conn.send((method, kwargs))
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"in-process helper ({self.label}): {value}")
        return value

    def close(self) -> None:
        try:
            self._conn.send(None)
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()
            self._proc.wait()


class InProcess:
    """Helpers: torch as configured by the environment and, with `openmp_variants`, torch with mpsd workers'
    OpenMP settings (irrelevant where the model runs on a GPU)."""

    def __init__(self, openmp_variants: bool = True, env: Mapping[str, str] | None = None) -> None:
        base = dict(os.environ if env is None else env)
        self.helpers = [Helper("default", base)]
        worker_env = worker_openmp_env(base)
        if openmp_variants and worker_env != base:
            self.helpers.append(Helper("worker-openmp", worker_env))

    @property
    def pids(self) -> list[int]:
        return [h.pid for h in self.helpers]

    def latency(self, path: str, shape: list[int], duration_s: float) -> list[int]:
        """Single-call latencies with torch as configured by the environment (a reference only)."""
        result: list[int] = self.helpers[0].call("latency", path=path, shape=shape, duration_s=duration_s)
        return result

    def batch_seconds(
        self,
        path: str,
        image: tuple[int, ...],
        batches: Mapping[int, int],
        dtype: str = "float32",
        device: str = "cpu",
        duration_s: float = 0.3,
        host_to_host: bool = False,
        graphs: bool = False,
    ) -> dict[str, dict[int, float]]:
        """Median seconds per call at each batch size, for each helper and the best of them ('best')."""
        kwargs = {
            "path": path,
            "image": list(image),
            "sizes": sorted(batches),
            "dtype": dtype,
            "device": device,
            "duration_s": duration_s,
            "host_to_host": host_to_host,
            "graphs": graphs,
        }
        out: dict[str, dict[int, float]] = {h.label: h.call("batch_seconds", **kwargs) for h in self.helpers}
        out["best"] = {size: min(out[h.label][size] for h in self.helpers) for size in batches}
        return out

    def close(self) -> None:
        for helper in self.helpers:
            helper.close()


def throughput_at(batches: Mapping[int, int], seconds: Mapping[int, float]) -> float:
    """Rows per second when executions come in the given mix of batch sizes (size -> executions)."""
    rows = sum(size * count for size, count in batches.items())
    busy = sum(seconds[size] * count for size, count in batches.items())
    return rows / busy if busy else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description="an in-process timing helper (started by the benchmark)")
    parser.add_argument("--fd", type=int, required=True)
    _serve(Connection(parser.parse_args().fd))


if __name__ == "__main__":
    main()
