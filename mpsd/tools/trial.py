"""Load a model version on the CPU in this process and run the worker's own warm-up on it.

`mpsd validate --load` and `mpsd init-model` use this instead of their own loading code, so that "it passed
here" means "a worker would load it": the same backend classes, the same warm-up inputs and output checks.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mpsd.config.repository import ModelSource

if TYPE_CHECKING:
    from mpsd.worker.inference import OutputMismatch


class TrialError(Exception):
    """Loading (`stage` "load"), running (`stage` "run") or warming up (`stage` "warm-up") failed; the
    message is the reason, and after a warm-up `mismatches` are the outputs that do not match the config."""

    def __init__(self, stage: str, message: str, mismatches: tuple[OutputMismatch, ...] = ()) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message
        self.mismatches = mismatches


def load_and_warm_up(source: ModelSource, version: int, device_type: str = "cpu") -> None:
    """Raise TrialError unless the version loads on the device (the CPU unless an AOTInductor package for
    another device is checked) and its warm-up outputs match the config."""
    import torch

    from mpsd.daemon.supervise.launch import model_spec
    from mpsd.worker.autocast import AutocastBackend, check_autocast
    from mpsd.worker.op_libraries import load_model
    from mpsd.worker.warmup import warmup_mismatch

    spec = model_spec(source, version)
    device = torch.device(device_type)
    torch.set_grad_enabled(False)  # as in the worker: a loaded model never trains
    try:
        check_autocast(spec, device)
        backend = load_model(spec, device)
        if spec.autocast is not None:
            backend = AutocastBackend(backend, spec, device)
    except Exception as exc:
        raise TrialError("load", f"{type(exc).__name__}: {exc}") from exc
    try:
        mismatch = warmup_mismatch(spec, backend, device)
    except Exception as exc:
        raise TrialError("run", f"{type(exc).__name__}: {exc}") from exc
    if mismatch is not None:
        raise TrialError("warm-up", str(mismatch), mismatch.outputs)


_APART = """
import sys
from pathlib import Path
from mpsd.config.repository import load_model_source
from mpsd.tools.trial import TrialError, load_and_warm_up
try:
    load_and_warm_up(load_model_source(Path(sys.argv[1])), int(sys.argv[2]), sys.argv[3])
except TrialError as exc:
    print(f"{exc.stage}\\t{exc.message}", file=sys.stderr)
    sys.exit(1)
"""


def load_and_warm_up_apart(model_dir: Path, version: int, device_type: str) -> None:
    """`load_and_warm_up` in a fresh process, as a worker starts: a process that has just compiled an
    AOTInductor package holds compiler and CUDA state that loading the package beside it can crash on."""
    done = subprocess.run(
        [sys.executable, "-c", _APART, str(model_dir), str(version), device_type],
        capture_output=True,
        text=True,
    )
    if done.returncode == 0:
        return
    last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
    stage, tab, message = last.partition("\t")
    if done.returncode == 1 and tab:
        raise TrialError(stage, message)
    raise TrialError("load", f"the checking process ended with status {done.returncode}: {last}")
