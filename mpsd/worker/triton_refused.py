"""The parts of Triton's `triton_python_backend_utils` that mpsd does not provide, each with the reason, and
the check that refuses a model using one at load rather than at its first request.

The check reads the model's source (its syntax tree): a use of a refused module name through the module
(`pb_utils.MetricFamily`, or `from triton_python_backend_utils import MetricFamily`), a call of a refused
method (`request.set_release_flags(...)`), or a refused argument (`parameters=` of a response or of a
call to another model). What the check cannot see (a name reached through getattr) is refused when used,
with the same reason.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

MODULE = "triton_python_backend_utils"

# Module-level names of Triton's module that mpsd refuses, and why.
REFUSED_NAMES = {
    "MetricFamily": "a model's own metrics are not exported: mpsd's /metrics has each model's request, "
    "queue and compute counts already (docs/observability.md)",
    "load_model": "models load from the repository as the daemon's config says: load them with `mpsd load` "
    "or the RepositoryModelLoad RPC, not from a model",
    "unload_model": "models unload as the daemon's config says: unload them with `mpsd unload` or the "
    "RepositoryModelUnload RPC, not from a model",
    "is_model_ready": "a model cannot ask the daemon for another model's state: call the model (a call to a "
    "model that is not ready answers an error response) or ask the daemon (ModelReady RPC)",
}
# Methods of Triton's objects that mpsd refuses, and why.
REFUSED_METHODS = {
    "set_release_flags": "requests cannot be rescheduled: each execution answers its request "
    "(TRITONSERVER_REQUEST_RELEASE_RESCHEDULE is not supported)",
}
# Keyword arguments mpsd refuses, by the class they are given to.
REFUSED_ARGUMENTS = {
    ("InferenceResponse", "parameters"): "a response's parameters are not sent to the client",
    ("InferenceRequest", "parameters"): "a call to another model carries tensors only, not parameters",
}
# What a sequence model (sequence_batching) cannot ask its requests.
SEQUENCE_METHODS = {
    "correlation_id": "one request stands for a batch whose rows may belong to different sequences: read "
    "the sequence's control inputs (sequence_batching.control_input) instead",
    "flags": "one request stands for a batch whose rows may belong to different sequences: read the "
    "START/END control inputs (sequence_batching.control_input) instead",
}


@dataclass(frozen=True)
class Refusal:
    line: int
    what: str
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.what} is not supported by mpsd: {self.reason}"


def refusals(source: str, sequence: bool = False) -> list[Refusal]:
    """Each use of a refused part of the module in a model's source, in the order written."""
    tree = ast.parse(source)
    aliases = {MODULE}  # the names the module is imported as
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases.update(a.asname or a.name for a in node.names if a.name == MODULE)
    methods = {**REFUSED_METHODS, **(SEQUENCE_METHODS if sequence else {})}
    found: list[Refusal] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == MODULE:
            for alias in node.names:
                if alias.name in REFUSED_NAMES:
                    found.append(Refusal(node.lineno, f"{MODULE}.{alias.name}", REFUSED_NAMES[alias.name]))
        elif isinstance(node, ast.Attribute):
            base = node.value
            if isinstance(base, ast.Name) and base.id in aliases and node.attr in REFUSED_NAMES:
                found.append(Refusal(node.lineno, f"{base.id}.{node.attr}", REFUSED_NAMES[node.attr]))
        elif isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if isinstance(func, ast.Attribute) and called in methods:
                found.append(Refusal(node.lineno, f".{called}()", methods[called]))
            for keyword in node.keywords:
                reason = REFUSED_ARGUMENTS.get((called, keyword.arg or ""))
                if reason is not None:
                    found.append(Refusal(node.lineno, f"{called}({keyword.arg}=...)", reason))
    return sorted(found, key=lambda r: r.line)


def refused_name(name: str) -> AttributeError:
    """The error for a refused module name reached at run time (the module's __getattr__)."""
    return AttributeError(f"{MODULE}.{name} is not supported by mpsd: {REFUSED_NAMES[name]}")
