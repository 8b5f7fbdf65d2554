"""AOTInductor packages from torch.export programs (`mpsd init-model --aoti`)."""

from __future__ import annotations

import time
from pathlib import Path

from mpsd.tools.common import ToolError


def compile_package(source: Path, target: Path, device: str) -> float:
    """Compile the program in `source` for `device` into the package `target`; returns the seconds it
    took. The program's dynamic dimensions (a batch dimension) stay dynamic in the package."""
    import torch

    program = torch.export.load(str(source))
    if device != "cpu":
        from torch.export.passes import move_to_device_pass

        program = move_to_device_pass(program, device)
    t0 = time.perf_counter()
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(target))
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ToolError(
            f"AOTInductor could not compile {source.name} for {device}: {first}",
            "AOTInductor needs a C++ compiler (and for cuda, the CUDA toolkit and a GPU); run with --debug "
            "for the whole error",
        ) from exc
    return time.perf_counter() - t0
