"""Load a model version on the CPU in this process and run the worker's own warm-up on it.

`mpsd validate --load` and `mpsd init-model` use this instead of their own loading code, so that "it passed
here" means "a worker would load it": the same backend classes, the same warm-up inputs and output checks.
"""

from __future__ import annotations

import re

from mpsd.config.repository import ModelSource

# How run_warmup starts the message of outputs that do not match the config ("warm-up: ..." for the default
# sample, "warm-up 'NAME': ..." for a configured one).
WARMUP_PREFIX = re.compile(r"^warm-up(?: '[^']*')?: ")


class TrialError(Exception):
    """Loading (`stage` "load") or warming up (`stage` "warm-up") failed; the message is the reason."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage
        self.message = message


def load_and_warm_up(source: ModelSource, version: int) -> None:
    """Raise TrialError unless the version loads on the CPU and its warm-up outputs match the config."""
    import torch

    from mpsd.daemon.supervise.launch import model_spec
    from mpsd.worker.backends import load_backend
    from mpsd.worker.inference import run_warmup

    spec = model_spec(source, version)
    device = torch.device("cpu")
    torch.set_grad_enabled(False)  # as in the worker: a loaded model never trains
    try:
        backend = load_backend(spec, device)
    except Exception as exc:
        raise TrialError("load", f"{type(exc).__name__}: {exc}") from exc
    try:
        run_warmup(spec, backend, device)
    except ValueError as exc:
        text = str(exc)
        if WARMUP_PREFIX.match(text):  # outputs that do not match the config, one part each
            raise TrialError("warm-up", text) from exc
        raise TrialError("run", f"{type(exc).__name__}: {exc}") from exc
    except Exception as exc:
        raise TrialError("run", f"{type(exc).__name__}: {exc}") from exc
