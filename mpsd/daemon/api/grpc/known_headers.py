"""ModelInfer headers seen before, and what their checks made of them.

A client sends the same header (the request without its tensor bytes: model, input names, datatypes and
shapes, requested outputs) again and again. Once a header has passed parsing and every check against a
model's config, its bytes are kept with the checked request they stand for. The next request with the same
bytes then skips protobuf parsing and the checks: its tensor bytes are bound to that request after their
sizes are checked. The key leaves the request's id out (each request's own id is read from its bytes), so
requests that differ only in their ids share an entry. A header is learned only where nothing in it
depends on the moment or on other state (no parameters: a timeout counts from now, shared memory names
regions), and it stands only for the config it was checked against: a reloaded model's new config sends it
through the full path again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpsd.config.model_config import ModelConfig
from mpsd.daemon.api.call import InferCall
from mpsd.daemon.api.parse import MAX_ID
from mpsd.daemon.dataplane.request import InferRequest, InputTensor
from mpsd.ipc import strings
from mpsd.ipc.infer_wire import MAX_KEY_BYTES

# What binds a request's bytes to its known header under the model's config now (`KnownHeaders.binder`).
Binder = Callable[[ModelConfig], InferRequest | None]
MAX_HEADERS = 1024  # past this many (request ids that change each time, say) the table starts again
MAX_HEADER_BYTES = MAX_KEY_BYTES


@dataclass(frozen=True)
class KnownInput:
    name: str
    datatype: str
    shape: tuple[int, ...]
    nbytes: int
    raw_index: int  # its entry among the request's raw_input_contents


@dataclass(frozen=True)
class KnownHeader:
    """A checked header: the request it stands for, less the tensor bytes."""

    model: str
    version: str
    config: ModelConfig  # the config it was checked against
    inputs: tuple[KnownInput, ...]  # in config order
    outputs: tuple[str, ...]
    batch_size: int
    raw_count: int
    request: InferRequest  # the request it was learned from (`requests.from_client`), less its bytes

    def bind(self, raw: Sequence[bytes | memoryview], request_id: str) -> InferRequest | None:
        """The request with these tensor bytes and this id; None when they do not fit the header (the full
        path then reports what is wrong)."""
        if len(raw) != self.raw_count:
            return None
        inputs = []
        for known in self.inputs:
            data = raw[known.raw_index]
            if len(data) != known.nbytes:
                return None
            inputs.append(InputTensor(known.name, known.datatype, known.shape, data))
        return _rebound(self.request, request_id, tuple(inputs))


def _rebound(request: InferRequest, request_id: str, inputs: tuple[InputTensor, ...]) -> InferRequest:
    """The request the header's first call became (`core.requests`, every request's rules), with another
    id and other tensor bytes: a copy of the frozen request's fields, not `dataclasses.replace`, which
    reads the class's fields and calls `__init__` again (4.3 against 0.6 us on the 2-core VM), for every
    request such a client sends."""
    rebound = object.__new__(InferRequest)
    fields = rebound.__dict__
    fields.update(request.__dict__)
    fields["id"] = request_id
    fields["inputs"] = inputs
    return rebound


def known_id(raw_id: bytes | None) -> str | None:
    """A request's id from its wire bytes, for a request with a known header; None when the full path must
    judge it (not UTF-8, or too long)."""
    if raw_id is None:
        return ""
    if len(raw_id) > MAX_ID:
        return None
    try:
        return raw_id.decode()
    except UnicodeDecodeError:
        return None


def learnable(call: InferCall) -> bool:
    """Whether a call's header can stand for later ones: every input in raw contents, no parameters, no
    strings (whose bytes are checked element by element, each time)."""
    if not call.raw or len(call.raw) != len(call.inputs) or call.parameters:
        return False
    if any(t.parameters or t.datatype == strings.DATATYPE for t in call.inputs):
        return False
    return not any(o.parameters for o in call.outputs)


def known_header(call: InferCall, parsed: InferRequest, config: ModelConfig) -> KnownHeader:
    """What a checked, `learnable` call's header stands for."""
    order = {t.name: i for i, t in enumerate(call.inputs)}
    inputs = []
    for t in parsed.inputs:
        assert isinstance(t.data, bytes | memoryview), "a learnable request's inputs are raw contents"
        inputs.append(KnownInput(t.name, t.datatype, t.shape, len(t.data), order[t.name]))
    return KnownHeader(
        parsed.model,
        parsed.version,
        config,
        tuple(inputs),
        parsed.outputs,
        parsed.batch_size,
        len(call.inputs),
        _rebound(parsed, "", ()),
    )


class KnownHeaders:
    """Checked headers by their bytes, at most MAX_HEADERS of them."""

    def __init__(self) -> None:
        self._known: dict[bytes, KnownHeader] = {}

    def __len__(self) -> int:
        return len(self._known)

    def get(self, header: bytes) -> KnownHeader | None:
        return self._known.get(header)

    def add(self, header: bytes, known: KnownHeader) -> None:
        if len(header) > MAX_HEADER_BYTES:
            return
        if len(self._known) >= MAX_HEADERS:
            self._known.clear()
        self._known[header] = known

    def forget(self, header: bytes) -> None:
        self._known.pop(header, None)

    def learner(self, header: bytes, call: InferCall) -> Callable[[InferRequest, ModelConfig], None] | None:
        """What learns `header` once its call passed the checks against a config (None: never learned)."""
        if not learnable(call):
            return None

        def learn(parsed: InferRequest, config: ModelConfig) -> None:
            self.add(header, known_header(call, parsed, config))

        return learn

    def binder(
        self, known: KnownHeader, header: bytes, raw: Sequence[bytes | memoryview], request_id: str
    ) -> Binder:
        """What binds a request's bytes to its known header under the model's config now: None once the
        config is not the one the header was checked against (forgotten then), or the bytes do not fit."""

        def bind(config: ModelConfig) -> InferRequest | None:
            if config is not known.config:
                self.forget(header)
                return None
            return known.bind(raw, request_id)

        return bind
