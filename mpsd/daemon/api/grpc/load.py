"""RepositoryModelLoad's parameters as Triton's gRPC server reads them: `config` a string_param, each
`file:<path>` a bytes_param, nothing else."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpsd.daemon.core.overrides import FILE_PREFIX, LoadParameters
from mpsd.errors import InvalidArgument


def load_parameters(parameters: Mapping[str, Any]) -> LoadParameters:
    """The request's parameters (ModelRepositoryParameter by name), checked with Triton's messages."""
    config: str | None = None
    files: dict[str, bytes] = {}
    for key, value in parameters.items():
        kind = value.WhichOneof("parameter_choice")
        if key == "config":
            if kind != "string_param":
                raise InvalidArgument(
                    f"invalid value type for load parameter '{key}', expected string_param."
                )
            config = value.string_param
        elif key.startswith(FILE_PREFIX):
            if kind != "bytes_param":
                raise InvalidArgument(f"invalid value type for load parameter '{key}', expected bytes_param.")
            files[key] = value.bytes_param
        else:
            raise InvalidArgument(f"unrecognized load parameter '{key}'.")
    return LoadParameters(config, files)
