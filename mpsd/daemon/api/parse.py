"""Checking an inference call (`api.call`, from either protocol) against the model's config before anything
reaches a worker.

Every check runs before any allocation sized by the request, and every message names the input and both
the expected and the received value.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import numpy as np

from mpsd.config.model_config import InputConfig, ModelConfig
from mpsd.daemon.api.call import TYPED_CONTENTS, InferCall, InputCall, OutputCall, Params, RawEntry
from mpsd.daemon.api.classification import PARAM as CLASSIFICATION
from mpsd.daemon.api.classification import class_count
from mpsd.daemon.api.client_shm import SHM_PARAMS, ShmLease, ShmRef, shm_ref
from mpsd.daemon.api.sequence_params import sequence_step
from mpsd.daemon.api.values import Values, typed_bytes
from mpsd.daemon.core import requests
from mpsd.daemon.core.inputs import (
    check_all_given,
    check_bytes,
    check_input,
    check_output,
    check_strings,
    unknown_input,
)
from mpsd.daemon.dataplane.request import Deferred, InferRequest, InputTensor
from mpsd.daemon.dataplane.tracing import RequestTrace
from mpsd.errors import InvalidArgument, Unimplemented
from mpsd.ipc import strings
from mpsd.ipc.dtypes import DATATYPES
from mpsd.ipc.protocol import RequestParameters

MAX_NAME = 256
MAX_ID = 4096
# Typed `contents` field and numpy dtype per datatype; FP16/BF16 have no typed field in the protocol.
TYPED_FIELDS: dict[str, tuple[str, Any]] = {
    name: (d.contents, np.dtype(d.numpy).type)
    for name, d in DATATYPES.items()
    if d.contents is not None and d.numpy is not None and d.itemsize is not None
}
_KNOWN_OUTPUT_PARAMS = {"binary_data"}
# Request parameters Triton clients send, with the value kinds each may have. `timeout` (microseconds) bounds
# the time to the start of the execution (`call_deadline`), or is the queue's timeout where the request's
# priority level lets it override the level's (`Deadline.queue`); `priority` is the request's priority level
# (the queue's, dataplane/priorities.py); the sequence ones place a request of a model with sequence batching
# in its sequence (`sequence_params`), and mean nothing to other models as in Triton; the others are accepted.
# Any other key is the model's own: a python model gets it (`infer(inputs, parameters)`), and any other model
# refuses it, so that a misspelt or unsupported option is never silently ignored.
REQUEST_PARAMS: dict[str, tuple[str, ...]] = {
    "sequence_id": ("int64", "uint64", "string"),
    "sequence_start": ("bool",),
    "sequence_end": ("bool",),
    "priority": ("uint64", "int64"),
    "timeout": ("int64", "uint64"),
    "binary_data_output": ("bool",),
    "triton_enable_empty_final_response": ("bool",),
    "headers": ("string",),
}
INPUT_PARAMS = SHM_PARAMS | {"binary_data_size"}
OUTPUT_PARAMS = SHM_PARAMS | _KNOWN_OUTPUT_PARAMS | {CLASSIFICATION}


def check_name(kind: str, name: str) -> None:
    if not name:
        raise InvalidArgument(f"{kind} name is empty")
    if len(name) > MAX_NAME:
        raise InvalidArgument(f"{kind} name is {len(name)} characters long; the limit is {MAX_NAME}")
    if not name.isprintable():  # control characters, lone surrogates, invisible separators
        raise InvalidArgument(f"{kind} name {name!a} contains control or unprintable characters")


def _check_parameters(where: str, parameters: Params, known: Collection[str]) -> None:
    unknown = sorted(k for k in parameters if k not in known)
    if unknown:
        names = ", ".join(ascii(k)[:80] for k in unknown[:5])
        raise InvalidArgument(f"{where}: unknown parameter(s) {names} (accepted: {', '.join(sorted(known))})")


def check_request_fields(call: InferCall, own: bool = False) -> RequestParameters:
    """The request-level fields: id and parameters (names and tensors are checked with the model). Returns
    the model's `own` parameters: those not in REQUEST_PARAMS, for a model that reads them (else refused)."""
    if len(call.id) > MAX_ID:
        raise InvalidArgument(f"request id is {len(call.id)} characters long; the limit is {MAX_ID}")
    if not call.parameters:
        return ()
    if not own:
        _check_parameters("request", call.parameters, REQUEST_PARAMS)
    for key, value in call.parameters.items():
        if key not in REQUEST_PARAMS:
            continue
        if value.kind not in REQUEST_PARAMS[key]:
            expected = " or ".join(REQUEST_PARAMS[key])
            raise InvalidArgument(
                f"request parameter '{key}' must be {expected}, got {value.kind or 'no value'}"
            )
        if key in ("timeout", "priority") and (value.integer() or 0) < 0:
            raise InvalidArgument(f"request parameter '{key}' must not be negative")
    if not own:
        return ()
    return tuple(sorted((k, v.value) for k, v in call.parameters.items() if k not in REQUEST_PARAMS))


def call_deadline(call: InferCall, client: float | None) -> requests.Deadline:
    """The call's deadlines: the client's (time.monotonic()), and the earlier of that and the call's
    `timeout` parameter (microseconds from now, 0 for none), by when it must have started."""
    timeout = call.parameters.get("timeout")
    micros = timeout.integer() if timeout is not None else None
    return requests.Deadline.of(client, micros or 0)


def _integer(call: InferCall, key: str) -> int:
    value = call.parameters.get(key)
    return (value.integer() or 0) if value is not None else 0


def _in_shm(tensor: InputCall) -> bool:
    return bool(tensor.parameters) and not SHM_PARAMS.isdisjoint(tensor.parameters)


def _typed_used(tensor: InputCall) -> list[str]:
    """The typed `contents` fields an input tensor fills."""
    if not tensor.contents:
        return []
    return [f for f in TYPED_CONTENTS if len(tensor.contents.get(f, ()))]


def _typed_bytes(name: str, datatype: str, tensor: InputCall, count: int) -> bytes:
    """Convert typed `contents` to raw bytes (strings serialized), checking the field and the element
    count."""
    used = _typed_used(tensor)
    if datatype == strings.DATATYPE:
        if used and used != ["bytes_contents"]:
            raise InvalidArgument(
                f"input '{name}': BYTES data belongs in contents.bytes_contents, got {', '.join(used)}"
            )
        elements = tensor.contents.get("bytes_contents", ())
        if len(elements) != count:
            raise InvalidArgument(f"input '{name}': contents has {len(elements)} elements, expected {count}")
        return strings.serialize(elements)
    typed = TYPED_FIELDS.get(datatype)
    if typed is None:
        raise InvalidArgument(f"input '{name}': {datatype} data must be sent in raw_input_contents")
    field_name, np_type = typed
    if used and used != [field_name]:
        raise InvalidArgument(
            f"input '{name}': {datatype} data belongs in contents.{field_name}, got {', '.join(used)}"
        )
    values = tensor.contents.get(field_name, ())
    if len(values) != count:
        raise InvalidArgument(f"input '{name}': contents has {len(values)} elements, expected {count}")
    return typed_bytes(f"input '{name}'", datatype, values, np_type)


def parse_infer_request(
    call: InferCall, config: ModelConfig, shm: ShmLease | None = None, trace: RequestTrace | None = None
) -> InferRequest:
    """Validate a call and return the data plane's request, with inputs in config order.

    Inputs in shared memory come back as views of the client's region and outputs in shared memory are
    bound in `shm`, which holds those regions until the response is built. The call's raw contents are
    views cut out of a gRPC request's wire bytes (`ipc/infer_wire.py`), or, from the HTTP adapter, an
    input's body bytes or its JSON elements (`Values`). What the request carries beyond its tensors
    (priority, timeout, parameters, cache eligibility) is decided by `core.requests`, as for every other
    source; `trace`: a traced request's spans, which it carries.
    """
    terms = call_terms(call, config)
    _check_raw(call)
    inputs, batch = _parsed_inputs(call, config, shm)
    outputs = _requested_outputs(call, config, shm)
    sequence = None
    if config.sequence_batching is not None:
        sequence = sequence_step(call, call.model, batch)
    return requests.from_client(
        config, call.model, call.version, call.id, inputs, outputs, batch, terms, sequence,
        shm_outputs=bool(shm is not None and shm.outputs), trace=trace,
    )  # fmt: skip


def call_terms(call: InferCall, config: ModelConfig) -> requests.Terms:
    """The call's checked id and parameters, as the terms of its request."""
    parameters = check_request_fields(call, own=requests.reads_parameters(config))
    if not call.parameters:
        return requests.NO_TERMS
    return requests.Terms(_integer(call, "priority"), _integer(call, "timeout"), parameters)


def _check_raw(call: InferCall) -> None:
    """Raw contents are all or nothing: one entry per input not in shared memory, and no typed contents."""
    raw: Sequence[RawEntry] = call.raw
    if not raw:
        return
    mixed = next((t.name for t in call.inputs if not _in_shm(t) and _typed_used(t)), None)
    if mixed is not None:  # Triton's check and words, before any count: the mix is what is wrong
        raise InvalidArgument(
            f"contents field must not be specified when using raw_input_contents for '{mixed}' "
            f"for model '{call.model}'"
        )
    in_request = sum(not _in_shm(t) for t in call.inputs)
    if len(raw) != in_request:
        where = " not in shared memory" if in_request < len(call.inputs) else ""
        raise InvalidArgument(
            f"raw_input_contents has {len(raw)} entries but the request has {in_request} inputs{where}; "
            "when raw contents are used every input must have one"
        )


def _parsed_inputs(
    call: InferCall, config: ModelConfig, shm: ShmLease | None
) -> tuple[tuple[InputTensor, ...], int]:
    """The call's inputs, each checked against the config, in config order; and the batch size."""
    configured = config.input_by_name
    raw = iter(call.raw)
    seen: dict[str, InputTensor] = {}
    batch: int | None = None
    for tensor in call.inputs:
        name = tensor.name
        check_name("input", name)
        if name in seen:
            raise InvalidArgument(f"duplicate input '{name}'")
        cfg = configured.get(name)
        if cfg is None:
            raise unknown_input(call.model, name, configured)
        ref = _input_ref(tensor, shm)
        check_input(call.model, cfg, tensor.datatype, tensor.shape, config.max_batch_size)
        if config.max_batch_size > 0:
            if batch is not None and tensor.shape[0] != batch:
                raise InvalidArgument(
                    f"input '{name}': batch size {tensor.shape[0]} differs from the other inputs' batch size "
                    f"{batch}"
                )
            batch = tensor.shape[0]
        seen[name] = InputTensor(
            name, cfg.wire_datatype, tuple(tensor.shape), _input_data(tensor, cfg, raw, shm, ref)
        )
    check_all_given(call.model, configured, seen)
    return tuple(seen[n] for n in configured), batch or 1


def _input_ref(tensor: InputCall, shm: ShmLease | None) -> ShmRef | None:
    """Where in a client's shared memory the input is, if it is."""
    if not tensor.parameters:
        return None
    name = tensor.name
    _check_parameters(f"input '{name}'", tensor.parameters, INPUT_PARAMS)
    if not _in_shm(tensor):
        return None
    ref = shm_ref(f"input '{name}'", tensor.parameters)
    if ref is not None and shm is None:
        raise Unimplemented(f"input '{name}': shared-memory inputs are not supported here")
    return ref


def _input_data(
    tensor: InputCall, cfg: InputConfig, raw: Iterator[RawEntry], shm: ShmLease | None, ref: ShmRef | None
) -> bytes | memoryview | Deferred:
    """An input's bytes: from the client's shared memory, its raw contents entry, or its typed contents."""
    name = tensor.name
    count = math.prod(tensor.shape)
    if ref is not None and shm is not None:
        if _typed_used(tensor):
            raise InvalidArgument(f"input '{name}': data is given both in shared memory and in contents")
        return _shm_data(name, cfg, shm, ref, count)
    entry = next(raw, None)
    if entry is None:
        return _typed_bytes(name, cfg.wire_datatype, tensor, count)
    data = entry.encode(f"input '{name}'", cfg.wire_datatype, count) if isinstance(entry, Values) else entry
    if cfg.itemsize is None:
        check_strings(name, data, count)
    else:
        check_bytes(name, cfg.wire_datatype, tensor.shape, cfg.itemsize, len(data))
    return data


def _shm_data(name: str, cfg: InputConfig, shm: ShmLease, ref: ShmRef, count: int) -> memoryview | Deferred:
    """An input in a client's shared memory: strings are checked now, so they are read now; other bytes
    are read when the batch is assembled."""
    if cfg.itemsize is None:
        place = shm.input(f"input '{name}'", ref, ref.byte_size)
        data = memoryview(bytearray(len(place)))
        place.read_into(data)
        check_strings(name, data, count)
        return data
    return shm.input(f"input '{name}'", ref, count * cfg.itemsize)


def _requested_outputs(call: InferCall, config: ModelConfig, shm: ShmLease | None) -> tuple[str, ...]:
    known = config.output_by_name
    names: list[str] = []
    for out in call.outputs:
        check_name("output", out.name)
        check_output(call.model, out.name, known, names)
        if out.parameters:
            _check_output_parameters(out, shm)
        names.append(out.name)
    return tuple(names) if names else tuple(known)


def _check_output_parameters(out: OutputCall, shm: ShmLease | None) -> None:
    _check_parameters(f"output '{out.name}'", out.parameters, OUTPUT_PARAMS)
    ref = None if SHM_PARAMS.isdisjoint(out.parameters) else shm_ref(f"output '{out.name}'", out.parameters)
    if ref is not None:
        if shm is None:
            raise Unimplemented(f"output '{out.name}': shared-memory outputs are not supported here")
        shm.bind_output(out.name, ref)
    classification = out.parameters.get(CLASSIFICATION)
    if classification is not None:
        class_count(out.name, classification)  # answered by `classification.classify`
