"""Registers `validate`, `infer`, `models` and `init-model` on the `mpsd` command line.

Each handler runs behind one guard: an expected failure (ToolError) is one line on stderr plus a hint and
its own exit status; anything else is one line too, with the traceback only under --debug.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mpsd.cli.connection import add_connection_args
from mpsd.tools.common import DEFAULT_CONFIG, ToolError, default_repository

Handler = Callable[[argparse.Namespace], int]


def _guarded(handler: Handler) -> Handler:
    @functools.wraps(handler)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return handler(args)
        except ToolError as exc:
            if getattr(args, "debug", False):
                raise
            print(f"mpsd {args.command}: {exc.message}", file=sys.stderr)
            if exc.hint:
                print(f"hint: {exc.hint}", file=sys.stderr)
            return exc.status
        except KeyboardInterrupt:
            return 130
        except Exception as exc:
            if getattr(args, "debug", False):
                raise
            print(f"mpsd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
            print("hint: run again with --debug for the full traceback", file=sys.stderr)
            return 1

    return wrapper


@_guarded
def _validate(args: argparse.Namespace) -> int:
    from mpsd.tools.validate import run

    repo, allow_symlinks = args.repository, args.allow_symlinks
    op_library_dirs: tuple[Path, ...] = ()
    if repo is None:
        repo, configured, op_library_dirs = default_repository(args.config)
        allow_symlinks = allow_symlinks or configured
    return run(repo, args.load, args.json, allow_symlinks, op_library_dirs)


@_guarded
def _infer(args: argparse.Namespace) -> int:
    from mpsd.tools.infer import run

    if not args.input:
        raise ToolError("no --input given", "give one --input NAME=VALUE per model input")
    return run(
        args,
        args.model,
        args.version,
        args.input,
        args.output or [],
        args.output_format,
        args.output_dir,
        args.timeout,
    )


@_guarded
def _models(args: argparse.Namespace) -> int:
    from mpsd.tools.models import run

    return run(args, args.ready, args.json, args.timeout)


@_guarded
def _init_model(args: argparse.Namespace) -> int:
    from mpsd.tools.init_model import run

    repo: Path = args.repository if args.repository is not None else default_repository(args.config)[0]
    examples = args.example_input or []
    if args.openai is not None:
        from mpsd.tools.init_openai import run as run_openai

        given = [o for o, v in (("--example-input", examples), ("--aoti", args.aoti)) if v]
        if args.max_batch_size is not None:
            given.append("--max-batch-size")
        if given:
            raise ToolError(
                f"--openai writes a python model: {', '.join(given)} do not apply", "leave them out"
            )
        return run_openai(args.name, args.openai, args.source, repo, args.version)
    return run(args.name, args.source, examples, repo, args.max_batch_size, args.version, args.aoti)


def _wrap(text: str) -> str:
    """Descriptions are filled here because the raw formatter (kept for the epilogs) does not fill them."""
    return textwrap.fill(text, width=min(shutil.get_terminal_size().columns - 2, 100))


def _debug(parser: argparse.ArgumentParser) -> None:
    # SUPPRESS keeps `mpsd --debug CMD` working: the sub-parser only sets it when given after CMD.
    parser.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")


def _address(parser: argparse.ArgumentParser, timeout: float) -> None:
    add_connection_args(parser, timeout)


def _config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        help=f"daemon config whose model_repository is the default (default {DEFAULT_CONFIG})",
    )


def add_tool_parsers(sub: Any) -> None:
    """Register validate, infer, models and init-model on the `mpsd` sub-command parser."""
    _add_validate(sub)
    _add_infer(sub)
    _add_models(sub)
    _add_init_model(sub)


def _add_validate(sub: Any) -> None:
    validate = sub.add_parser(
        "validate",
        help="check a model repository without starting the daemon",
        description=_wrap(
            "Check every model's config.yaml against the schema and its version directories and "
            "files; with --load, also load each version on the CPU and run the worker's warm-up, which "
            "checks the output dims and datatypes. Every problem is printed with its file, field and a fix. "
            "Exit status: 0 when every model is valid, 1 otherwise."
        ),
        epilog="examples:\n  mpsd validate                    # the repository of config/mpsd.yaml\n"
        "  mpsd validate config/models --load\n  mpsd validate models --json | jq '.problems'",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    validate.add_argument(
        "repository", nargs="?", type=Path, help="model repository (default: the one config/mpsd.yaml names)"
    )
    validate.add_argument(
        "--load",
        action="store_true",
        help="also load each model on the CPU and warm it up (runs python models' code, as the daemon would)",
    )
    validate.add_argument("--json", action="store_true", help="machine-readable report on stdout")
    validate.add_argument(
        "--allow-symlinks",
        action="store_true",
        help="accept symlinks that leave the repository, as a daemon with allow_symlinks: true does "
        "(default: the daemon config's setting when the repository comes from it)",
    )
    _config(validate)
    _debug(validate)
    validate.set_defaults(func=_validate)


def _add_infer(sub: Any) -> None:
    infer = sub.add_parser(
        "infer",
        help="send one inference request to a running daemon and print the outputs",
        description="Call MODEL on a running daemon. Each --input is NAME=VALUE, where VALUE is a JSON "
        "list, a number, or @file.npy. The datatype and shape come from the model's metadata; when the "
        "model batches and the value has no batch dimension, a batch of one is sent.",
        epilog="examples:\n"
        "  mpsd infer add_sub --input 'INPUT0=[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16]' "
        "--input INPUT1=@ones.npy\n"
        "  mpsd infer scale --input 'x=[1, 2, 3]' --output-format json\n"
        "  mpsd infer tiny_cnn --input image=@image.npy --output-format npy --output-dir out/",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    infer.add_argument("model", help="model name")
    infer.add_argument(
        "--input", "-i", action="append", metavar="NAME=VALUE", help="one per model input (repeatable)"
    )
    infer.add_argument("--version", default="", help="model version (default: the latest ready one)")
    infer.add_argument(
        "--output", "-o", action="append", metavar="NAME", help="only these outputs (default: all)"
    )
    infer.add_argument(
        "--output-format",
        choices=["table", "json", "npy"],
        default="table",
        help="table (default); json: KServe v2 JSON layout; npy: one NAME.npy per output",
    )
    infer.add_argument(
        "--output-dir", type=Path, default=Path("."), help="where npy files go (default: here)"
    )
    _address(infer, 60.0)
    _debug(infer)
    infer.set_defaults(func=_infer)


def _add_models(sub: Any) -> None:
    models = sub.add_parser(
        "models",
        help="the models of a running daemon, with state and reason (`mpsd status` adds workers)",
        epilog="example: mpsd models --ready",
    )
    models.add_argument("--ready", action="store_true", help="only versions that are ready")
    models.add_argument("--json", action="store_true", help="machine-readable output")
    _address(models, 10.0)
    _debug(models)
    models.set_defaults(func=_models)


def _add_init_model(sub: Any) -> None:
    init = sub.add_parser(
        "init-model",
        help="create a model directory (config.yaml and version 1) from a .pt or .pt2 file, or a model that "
        "serves OpenAI's API from a Hugging Face model folder",
        description=_wrap(
            "Write <repository>/NAME/config.yaml and copy the file to <repository>/NAME/1/. "
            "Input names come from forward()'s arguments (TorchScript) or the program (torch.export); "
            "output names, datatypes and dims from trial runs on the CPU. A TorchScript model needs one "
            "--example-input SHAPE:DTYPE per argument (SHAPE without the batch dimension, ? for a variable "
            "size); a .pt2 program records its shapes, and a dynamic first dimension turns batching on. The "
            "new model is checked with the worker's own loading and warm-up before it is moved into place. "
            "With --openai embeddings|chat, --from is a Hugging Face model folder (save_pretrained: "
            "config.json, weights, tokenizer) and the model written is a python model serving "
            "/v1/embeddings or /v1/chat/completions (docs/openai.md)."
        ),
        epilog="examples:\n"
        "  mpsd init-model add_sub --from add_sub.pt --example-input 16:FP32 --example-input 16:FP32 "
        "--max-batch-size 8\n"
        "  mpsd init-model classifier --from classifier.pt2 --repository config/models\n"
        "  mpsd init-model classifier_aoti --from classifier.pt2 --aoti cuda\n"
        "  mpsd init-model minilm --openai embeddings --from ./all-MiniLM-L6-v2\n"
        "  mpsd init-model assistant --openai chat --from ./Qwen2.5-0.5B-Instruct",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    init.add_argument("name", help="model name (the directory name)")
    _init_model_sources(init)
    _init_model_results(init)
    _config(init)
    _debug(init)
    init.set_defaults(func=_init_model)


def _init_model_sources(init: argparse.ArgumentParser) -> None:
    """What the model is made from: the file (with --openai, the Hugging Face folder) and the example inputs
    a TorchScript file needs."""
    init.add_argument(
        "--from",
        dest="source",
        type=Path,
        required=True,
        metavar="FILE",
        help="model.pt (torch.jit.save) or model.pt2 (torch.export.save); with --openai, a Hugging Face "
        "model folder",
    )
    init.add_argument(
        "--openai",
        choices=("embeddings", "chat"),
        help="write a python model serving OpenAI's /v1/embeddings or /v1/chat/completions from the Hugging "
        "Face model folder --from names (transformers must be installed)",
    )
    init.add_argument(
        "--example-input",
        action="append",
        metavar="SHAPE:DTYPE",
        help="e.g. 3x224x224:FP32, 16:int64 or ?:FP32 (? = any size); one per forward() argument, in order "
        "(TorchScript only)",
    )


def _init_model_results(init: argparse.ArgumentParser) -> None:
    """Where the model goes and what its config.yaml and files say."""
    init.add_argument(
        "--repository", type=Path, help="model repository (default: the one config/mpsd.yaml names)"
    )
    init.add_argument(
        "--max-batch-size",
        type=int,
        metavar="N",
        help="0: no batching (default for .pt); .pt2 default: the program's batch bound, at most 64",
    )
    init.add_argument("--version", type=int, default=1, help="version directory to create (default 1)")
    init.add_argument(
        "--aoti",
        nargs="?",
        const="cpu",
        choices=("cpu", "cuda", "mps"),
        metavar="DEVICE",
        help="compile the .pt2 program with AOTInductor for DEVICE (cpu, cuda or mps; default cpu) and write "
        "model.aoti.pt2 with backend aoti (needs a C++ compiler; cuda needs that GPU here)",
    )
