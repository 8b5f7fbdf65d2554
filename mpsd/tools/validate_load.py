"""`mpsd validate --load`: load each version on the CPU with the worker's own code and warm it up, and
turn what fails into problems at the config field to change."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from mpsd.config.repository import CONFIG_FILE, ModelSource, config_path
from mpsd.ipc.dtypes import wire_to_config
from mpsd.tools.trial import TrialError, load_and_warm_up
from mpsd.tools.validate_fields import DOCS, field_path, line_of
from mpsd.tools.validate_report import ModelReport, Problem

LOAD_HINTS = {
    "torchscript": "model.pt must be written by torch.jit.save (a scripted or traced module), not torch.save",
    "torch_export": "model.pt2 must be written by torch.export.save from the same major PyTorch version",
    "aoti": "model.aoti.pt2 must be written by torch._inductor.aoti_compile_and_package with this PyTorch "
    "version, for the instance's device type (`mpsd init-model --aoti` writes one)",
    "python": "model.py must define `class Model` with __init__(self, config, device) and "
    "infer(self, inputs)",
}


def _index_of(tensors: Sequence[Any], name: str) -> int | None:
    return next((i for i, t in enumerate(tensors) if t.name == name), None)


def _trial_problems(source: ModelSource, version: int, error: TrialError) -> list[Problem]:
    config = source.config
    assert config is not None
    model_file = str(source.path / str(version) / config.model_filename)
    cfg_path = config_path(source.path)[0]
    cfg_file = str(cfg_path)
    text = cfg_path.read_text() if cfg_path.name == CONFIG_FILE else ""  # lines are found in YAML only
    if error.stage == "load":
        hint = LOAD_HINTS[config.backend]
        return [Problem(source.name, model_file, "", f"cannot load: {error.message}", hint)]
    if error.stage == "run":
        return [
            Problem(
                source.name,
                model_file,
                "input",
                f"the model failed on the warm-up inputs: {error.message}",
                "the warm-up feeds zeros shaped like the input dims (batch 1 when batching, -1 as 1): check "
                "the inputs' order, dims and data_type against the model's forward()",
                line_of(text, ("input",)),
            )
        ]
    problems = []
    for mismatch in error.mismatches:
        index = _index_of(config.output, mismatch.output)
        if index is None:
            problems.append(Problem(source.name, cfg_file, "output", mismatch.message, f"see {DOCS}"))
            continue
        if mismatch.shape is not None:
            got = list(mismatch.shape)
            dims = got[1:] if config.max_batch_size > 0 else got
            loc: tuple[int | str, ...] = ("output", index, "dims")
            hint = f"set dims: {dims}"
            if config.max_batch_size > 0:
                hint += " (the batch dimension is left out)"
        else:
            loc = ("output", index, "data_type")
            hint = f"set data_type: {wire_to_config(str(mismatch.datatype))}, or change the model"
        problems.append(
            Problem(source.name, cfg_file, field_path(loc), mismatch.message, hint, line_of(text, loc))
        )
    return problems


Progress = Callable[[str], None]


def stderr_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def load_models(
    sources: Sequence[tuple[ModelReport, ModelSource]], progress: Progress = stderr_progress
) -> None:
    """Load every version of each model on the CPU and warm it up, recording problems in its report."""
    total = sum(len(source.versions) for _, source in sources)
    done = 0
    for report, source in sources:
        loaded = True
        for v in source.versions:
            done += 1
            assert source.config is not None
            label = f"[{done}/{total}] {source.name} version {v}"
            progress(f"{label}: loading ({source.config.backend}) and warming up on the CPU")
            t0 = time.perf_counter()
            try:
                load_and_warm_up(source, v)
            except TrialError as exc:
                loaded = False
                report.problems.extend(_trial_problems(source, v, exc))
                progress(f"{label}: failed ({exc.stage})")
            else:
                progress(f"{label}: ok ({time.perf_counter() - t0:.1f} s)")
        report.loaded = loaded
