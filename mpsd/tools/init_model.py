"""`mpsd init-model`: turn a TorchScript or torch.export file into a model directory that serves; with
`--aoti`, a torch.export program is compiled into an AOTInductor package on the way.

The config is inferred, not guessed: input names come from the model's signature, output names, datatypes
and dims from trial runs on the CPU. The result is built beside the repository's models in a hidden
directory, checked with the worker's own loading and warm-up code, and only then renamed into place, so a
watching daemon never sees a half-written model.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from mpsd.config.model_config import DEFAULT_FILENAMES
from mpsd.config.repository import CONFIG_FILE, MODEL_NAME_RE, load_model_source
from mpsd.ipc.dtypes import config_to_wire, wire_to_config
from mpsd.tools.common import ToolError
from mpsd.tools.trial import TrialError, load_and_warm_up, load_and_warm_up_apart

if TYPE_CHECKING:
    import torch

BACKENDS = {".pt": "torchscript", ".pt2": "torch_export"}
EXAMPLE_HINT = "give one --example-input SHAPE:DTYPE per forward() argument, in order, e.g. 3x224x224:FP32"
DEFAULT_BATCH_CAP = 64


@dataclass(frozen=True)
class TensorDraft:
    """An input or output of the config being written: dims without the batch dimension, -1 = variable."""

    name: str
    data_type: str
    dims: tuple[int, ...]

    def as_yaml(self) -> str:
        entry = {"name": self.name, "data_type": self.data_type, "dims": list(self.dims)}
        return yaml.safe_dump(entry, default_flow_style=True, sort_keys=False).strip()


@dataclass(frozen=True)
class ExampleInput:
    """What one input looks like in a trial: its name, dims (without batch, -1 = variable) and dtype."""

    name: str
    dims: tuple[int, ...]
    dtype: torch.dtype


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _first_line(exc: BaseException) -> str:
    """PyTorch's messages run to many lines of C++ context; the first says what went wrong."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    if "TorchScript interpreter" in lines[0]:  # the interpreter's own error is the last line
        return lines[-1]
    return f"{type(exc).__name__}: {lines[0]}"


# ---- parsing -----------------------------------------------------------------------------------------


def parse_dtype(text: str) -> torch.dtype:
    """`FP32`, `TYPE_FP32` or a torch name such as `float32` / `int64`."""
    import torch

    from mpsd.worker.dtypes import FROM_TORCH, TO_TORCH

    wire = config_to_wire(text.upper())
    if wire in TO_TORCH:
        return TO_TORCH[wire]
    candidate = getattr(torch, text.lower(), None)
    if isinstance(candidate, torch.dtype) and candidate in FROM_TORCH:
        return candidate
    raise ToolError(f"unknown datatype '{text}'", "use one of " + ", ".join(TO_TORCH))


def parse_example(text: str) -> tuple[tuple[int, ...], torch.dtype]:
    """`3x32x32:FP32` or `16,4:int64` -> dims and dtype; `?` (or -1) marks a variable dimension."""
    shape, sep, dtype = text.rpartition(":")
    if not sep:
        raise ToolError(f"--example-input {text!r}: expected SHAPE:DTYPE", EXAMPLE_HINT)
    parts = [p for p in re.split(r"[x,\s]+", shape.strip()) if p]
    try:
        dims = tuple(-1 if p == "?" else int(p) for p in parts)
    except ValueError:
        raise ToolError(
            f"--example-input {text!r}: SHAPE must be integers like 3x32x32", EXAMPLE_HINT
        ) from None
    if any(d == 0 or d < -1 for d in dims):
        raise ToolError(
            f"--example-input {text!r}: sizes are positive, or ? for a variable size", EXAMPLE_HINT
        )
    return dims, parse_dtype(dtype)


# ---- reading the model's signature ---------------------------------------------------------------------


def _symbolic(dim: object) -> bool:
    return not isinstance(dim, int)


def torchscript_inputs(module: Any, examples: Sequence[str]) -> list[ExampleInput]:
    """forward()'s argument names, with the shapes and dtypes given on the command line."""
    arguments = [a for a in module.forward.schema.arguments if a.name != "self"]
    for a in arguments:
        if str(a.type) not in ("Tensor", "Optional[Tensor]"):
            raise ToolError(
                f"forward() argument '{a.name}' is {a.type}, not a Tensor",
                "mpsd passes every input as a tensor: wrap the model so that forward() takes tensors only",
            )
    names = [a.name for a in arguments]
    if len(examples) != len(names):
        raise ToolError(
            f"forward() takes {len(names)} input(s) ({', '.join(names)}) but {len(examples)} "
            "--example-input were given",
            EXAMPLE_HINT,
        )
    parsed = [parse_example(e) for e in examples]
    return [ExampleInput(n, dims, dtype) for n, (dims, dtype) in zip(names, parsed, strict=True)]


@dataclass(frozen=True)
class ProgramShapes:
    """What a torch.export program records: input shapes with symbols, output shapes, symbol ranges."""

    inputs: list[tuple[str, tuple[object, ...], torch.dtype]]
    outputs: list[tuple[object, ...]]
    ranges: Mapping[str, tuple[int | None, int | None]]


def program_shapes(program: Any) -> ProgramShapes:
    import torch

    user_inputs = set(program.graph_signature.user_inputs)
    inputs: list[tuple[str, tuple[object, ...], torch.dtype]] = []
    outputs: list[tuple[object, ...]] = []
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in user_inputs:
            value = node.meta.get("val")
            if not isinstance(value, torch.Tensor):
                raise ToolError(
                    f"program input '{node.name}' is not a tensor",
                    "export the model with tensor inputs only: mpsd passes every input as a tensor",
                )
            inputs.append((node.name, tuple(value.shape), value.dtype))
        elif node.op == "output":
            for arg in node.args[0]:
                value = getattr(arg, "meta", {}).get("val")
                outputs.append(tuple(value.shape) if isinstance(value, torch.Tensor) else ())
    ranges: dict[str, tuple[int | None, int | None]] = {}
    for symbol, bounds in program.range_constraints.items():
        lower, upper = bounds.lower, bounds.upper
        ranges[str(symbol)] = (
            int(lower) if getattr(lower, "is_finite", True) else None,
            int(upper) if getattr(upper, "is_finite", False) or isinstance(upper, int) else None,
        )
    return ProgramShapes(inputs, outputs, ranges)


def export_inputs(shapes: ProgramShapes, max_batch_size: int | None) -> tuple[list[ExampleInput], int]:
    """Inputs from the program's own shapes; a shared symbolic first dimension means batching."""
    first = {str(shape[0]) if shape else "" for _, shape, _ in shapes.inputs}
    dynamic_batch = len(first) == 1 and all(shape and _symbolic(shape[0]) for _, shape, _ in shapes.inputs)
    if max_batch_size is None:
        max_batch_size = 0
        if dynamic_batch:
            upper = shapes.ranges.get(first.pop(), (None, None))[1]
            max_batch_size = min(upper, DEFAULT_BATCH_CAP) if upper is not None else DEFAULT_BATCH_CAP
    elif max_batch_size > 0 and not dynamic_batch:
        raise ToolError(
            "the program's inputs do not share a dynamic first dimension, so it cannot take batches",
            "export with dynamic_shapes marking dimension 0 of every input (torch.export.Dim), "
            "or pass --max-batch-size 0",
        )
    drop = 1 if max_batch_size > 0 else 0
    examples = [
        ExampleInput(name, tuple(-1 if _symbolic(d) else int(str(d)) for d in shape[drop:]), dtype)
        for name, shape, dtype in shapes.inputs
    ]
    return examples, max_batch_size


# ---- trial runs ------------------------------------------------------------------------------------------


def _flatten(result: object) -> list[tuple[str | None, torch.Tensor]]:
    """What forward() returned, as (name or None, tensor) in the order the worker maps outputs."""
    import torch

    if isinstance(result, torch.Tensor):
        return [(None, result)]
    if isinstance(result, (tuple, list)):
        items: list[tuple[str | None, torch.Tensor]] = [(None, r) for r in result]
    elif isinstance(result, Mapping):
        items = [(str(k), v) for k, v in result.items()]
    else:
        raise ToolError(
            f"forward() returned {type(result).__name__}",
            "mpsd serves models that return a tensor, a tuple/list of tensors or a dict of tensors",
        )
    for name, value in items:
        if not isinstance(value, torch.Tensor):
            raise ToolError(
                f"forward() returned a {type(value).__name__} among its outputs ({name or 'by position'})",
                "return tensors only",
            )
    return items


def trial(module: Any, inputs: Sequence[ExampleInput], batch: int | None, variable: int) -> list[Any]:
    """Run forward() on zeros: `batch` prepended when batching, -1 dims as `variable`."""
    import torch

    tensors = [
        torch.zeros(
            ([batch] if batch is not None else []) + [variable if d == -1 else d for d in i.dims],
            dtype=i.dtype,
        )
        for i in inputs
    ]
    try:
        with torch.inference_mode():
            return _flatten(module(*tensors))
    except ToolError:
        raise
    except Exception as exc:
        shapes = ", ".join(f"{i.name} {list(t.shape)}" for i, t in zip(inputs, tensors, strict=True))
        raise ToolError(
            f"the trial run failed with inputs {shapes}: {_first_line(exc)}",
            "check the --example-input shapes and datatypes (the batch dimension is added when batching)",
        ) from None


def infer_outputs(
    module: Any, inputs: Sequence[ExampleInput], max_batch_size: int, symbolic: Sequence[tuple[object, ...]]
) -> list[TensorDraft]:
    """Names, datatypes and dims of the outputs. A dim is -1 where the program records a symbol or where
    a second trial with other sizes changes it; every output must follow the batch when batching."""
    from mpsd.worker.dtypes import datatype_of

    batched = max_batch_size > 0
    first = trial(module, inputs, 1 if batched else None, 1)
    second = None
    if not symbolic and (batched or any(-1 in i.dims for i in inputs)):
        second = trial(module, inputs, 2 if batched else None, 3)
    drafts = []
    for index, (name, tensor) in enumerate(first):
        label = name if name is not None else f"OUTPUT{index}"
        try:
            data_type = wire_to_config(datatype_of(tensor))
        except TypeError as exc:
            raise ToolError(
                f"output {label}: {exc}", "convert it inside forward() to a supported dtype"
            ) from None
        dims = list(tensor.shape)
        if symbolic and index < len(symbolic) and len(symbolic[index]) == len(dims):
            dims = [-1 if _symbolic(s) else d for s, d in zip(symbolic[index], dims, strict=True)]
        if second is not None and index < len(second):
            other = list(second[index][1].shape)
            if len(other) == len(dims):
                dims = [d if d == o else -1 for d, o in zip(dims, other, strict=True)]
        if batched:
            if not dims or dims[0] != -1:
                raise ToolError(
                    f"output {label} (shape {list(tensor.shape)}) does not follow the batch dimension",
                    "pass --max-batch-size 0 to serve the model without batching",
                )
            dims = dims[1:]
        drafts.append(TensorDraft(label, data_type, tuple(dims)))
    return drafts


# ---- writing -----------------------------------------------------------------------------------------


def config_text(
    name: str,
    backend: str,
    source: Path,
    max_batch_size: int,
    inputs: Sequence[TensorDraft],
    outputs: Sequence[TensorDraft],
) -> str:
    lines = [
        f"# Written by `mpsd init-model` from {source.name}: inputs and outputs come from a trial run.",
        "# Rename tensors freely: inputs are passed to forward() in this order, outputs map by position",
        "# (or by key when forward() returns a dict). Reference: docs/configuration.md",
        f"name: {name}",
        f"backend: {backend}",
        f"max_batch_size: {max_batch_size}",
        "input:",
        *(f"  - {t.as_yaml()}" for t in inputs),
        "output:",
        *(f"  - {t.as_yaml()}" for t in outputs),
        "instance_group:",
        "  - {kind: KIND_AUTO, count: 1}",
    ]
    return "\n".join(lines) + "\n"


def draft_config(
    name: str, source: Path, examples: Sequence[str], max_batch_size: int | None, aoti: str | None = None
) -> str:
    """Load the file on the CPU, read its signature, run it, and return the config text (backend aoti when
    the program is to be compiled into an AOTInductor package)."""
    import torch

    from mpsd.worker.dtypes import datatype_of

    backend = BACKENDS.get(source.suffix)
    if backend is None:
        raise ToolError(
            f"{source}: cannot tell the backend from the suffix '{source.suffix}'",
            "give a TorchScript file (.pt, from torch.jit.save) or a torch.export program "
            "(.pt2, from torch.export.save)",
        )
    if aoti is not None and backend != "torch_export":
        raise ToolError(
            f"--aoti compiles a torch.export program, and {source.name} is {backend}",
            "export the model with torch.export.export and torch.export.save it to a .pt2 file first",
        )
    _progress(f"loading {source} ({backend}) on the CPU")
    try:
        if backend == "torchscript":
            module: Any = torch.jit.load(str(source), map_location="cpu")  # type: ignore[no-untyped-call]
            module.eval()
        else:
            program = torch.export.load(str(source))
            module = program.module()
    except Exception as exc:
        hint = {
            "torchscript": "a .pt file must be written by torch.jit.save (not torch.save)",
            "torch_export": "a .pt2 file must be written by torch.export.save",
        }[backend]
        raise ToolError(f"{source}: cannot load: {_first_line(exc)}", hint) from None

    symbolic: list[tuple[object, ...]] = []
    if backend == "torchscript":
        if max_batch_size is None:
            max_batch_size = 0
        inputs = torchscript_inputs(module, examples)
    else:
        if examples:
            raise ToolError(
                "a .pt2 program records its own input shapes", "leave out --example-input for .pt2 files"
            )
        shapes = program_shapes(program)
        inputs, max_batch_size = export_inputs(shapes, max_batch_size)
        symbolic = shapes.outputs
    _progress("running the model on zeros to find its outputs")
    outputs = infer_outputs(module, inputs, max_batch_size, symbolic)
    drafts = [
        TensorDraft(i.name, wire_to_config(datatype_of(torch.empty(0, dtype=i.dtype))), i.dims)
        for i in inputs
    ]
    return config_text(name, "aoti" if aoti else backend, source, max_batch_size, drafts, outputs)


def publish(repo: Path, name: str, version: int, text: str, source: Path, aoti: str | None = None) -> Path:
    """Write the model into a hidden directory, check it as a worker would, then rename it into place.

    With `aoti` (a device type), the program is compiled into an AOTInductor package for that device
    instead of copied, and checked on that device."""
    backend = yaml.safe_load(text)["backend"]

    def fill(version_dir: Path) -> None:
        target_file = version_dir / DEFAULT_FILENAMES[backend]
        if aoti is not None:
            from mpsd.tools.aoti import compile_package

            _progress(f"compiling {source.name} with AOTInductor for {aoti} (this takes a while)")
            seconds = compile_package(source, target_file, aoti)
            _progress(f"compiled in {seconds:.1f} s")
        else:
            shutil.copyfile(source, target_file)

    return staged(repo, name, version, text, fill, aoti)


def staged(
    repo: Path, name: str, version: int, text: str, fill: Callable[[Path], None], aoti: str | None = None
) -> Path:
    """Write the config and (`fill`) the version folder into a hidden directory beside the repository's
    models, check the model with the worker's loading and warm-up (on `aoti`'s device, apart, for an
    AOTInductor package), and only then rename it into place, so a watching daemon never sees it half
    written."""
    target = repo / name
    staging = repo / f".{name}.init-{os.getpid()}"
    try:
        model_dir = staging / name
        (model_dir / str(version)).mkdir(parents=True)
        (model_dir / CONFIG_FILE).write_text(text)
        fill(model_dir / str(version))
        model = load_model_source(model_dir)
        if model.error is not None:
            raise ToolError(f"the written config is invalid: {model.error}", "please report this as a bug")
        _progress("checking the new model with the worker's loading and warm-up code")
        try:
            if aoti is not None:
                load_and_warm_up_apart(model_dir, version, aoti)
            else:
                load_and_warm_up(model, version)
        except TrialError as exc:
            raise ToolError(
                f"the new model fails its {exc.stage}: {exc.message}",
                "edit the generated config by hand; `mpsd validate --load` rechecks it",
            ) from None
        if target.exists():
            raise ToolError(f"{target} appeared while the model was being written", "run the command again")
        os.rename(model_dir, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def check_new(repo: Path, name: str, version: int) -> None:
    """ToolError unless `name` can be a new model of `repo` at `version`."""
    if not MODEL_NAME_RE.match(name):
        raise ToolError(
            f"invalid model name '{name}'", "use letters, digits, '_', '.' and '-' (not first), up to 128"
        )
    if version < 1:
        raise ToolError(f"version {version} is not allowed", "versions are positive integers: 1, 2, ...")
    target = repo / name
    if target.exists():
        raise ToolError(
            f"{target} already exists",
            f"choose another NAME or remove it; to add a version, copy the file to {target}/<N>/",
        )


def run(
    name: str,
    source: Path,
    examples: Sequence[str],
    repo: Path,
    max_batch_size: int | None,
    version: int,
    aoti: str | None = None,
) -> int:
    check_new(repo, name, version)
    if not source.is_file():
        raise ToolError(f"{source} does not exist", "pass the model file with --from PATH")
    if max_batch_size is not None and max_batch_size < 0:
        raise ToolError(f"--max-batch-size {max_batch_size} is negative", "0 turns batching off")
    text = draft_config(name, source, examples, max_batch_size, aoti)
    repo.mkdir(parents=True, exist_ok=True)
    written = publish(repo, name, version, text, source, aoti)
    print(text, end="")
    example = " ".join(f"--input {t['name']}=0" for t in yaml.safe_load(text)["input"])
    _progress(
        f"wrote {written}/{CONFIG_FILE} and {written}/{version}/; a daemon watching {repo} loads it now "
        f"(otherwise `mpsd reload`). Try: mpsd infer {name} {example}"
    )
    return 0
