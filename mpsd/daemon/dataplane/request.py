"""Requests and results as the daemon handles them, independent of protobuf."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from mpsd.daemon.dataplane.tracing import RequestTrace
    from mpsd.ipc.protocol import WorkerSpan

from mpsd.ipc.protocol import RequestParameters


class Deferred(Protocol):
    """Input bytes read only when the batch is assembled, straight into the worker's region (a client's
    shared memory); `read_into` raises MpsdError when they cannot be read any more."""

    def __len__(self) -> int: ...

    def read_into(self, dest: memoryview) -> None: ...


class InputTensor(NamedTuple):
    """A validated input: its bytes are exactly shape x datatype. A named tuple, as `OutputTensor`: one
    is made for every tensor of every request on the daemon's thread, and a frozen dataclass costs three
    times as much to make."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes | memoryview | Deferred


@dataclass(frozen=True)
class SequenceStep:
    """A request's place in a stateful sequence (sequence batching): its correlation ID, whether it starts
    or ends the sequence, and, once scheduled, the slot of its instance that holds the sequence."""

    corrid: int | str
    start: bool = False
    end: bool = False
    slot: int = -1


@dataclass(frozen=True)
class InferRequest:
    model: str
    version: str
    id: str
    inputs: tuple[InputTensor, ...]  # in config order
    outputs: tuple[str, ...]  # requested outputs, never empty
    batch_size: int = 1
    # The model versions (name, version) a request made by a model's call came through: a call may not
    # come back to one of them (it would wait for itself). Empty for a client's request.
    chain: frozenset[tuple[str, int]] = frozenset()
    # The client's own request parameters, for a model that reads them (a python model); empty otherwise.
    parameters: RequestParameters = ()
    sequence: SequenceStep | None = None  # set for a model with sequence batching only
    trace: RequestTrace | None = None  # a traced request's spans (dataplane/tracing.py); None: not traced
    # The request's `priority` and `timeout` (microseconds) parameters, 0 where not given: the queue finds
    # the request's priority level and that level's timeout from them (dataplane/priorities.py).
    priority: int = 0
    timeout_us: int = 0
    # Whether the response cache may answer it; decided where every request is built (core/requests.py).
    cacheable: bool = False


class OutputTensor(NamedTuple):
    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(slots=True)
class Timings:
    """Nanoseconds spent in each phase of one request, as Triton's statistics split them."""

    queue_ns: int = 0
    worker_wait_ns: int = 0  # of an execution: sent to its worker until the worker started it
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0
    device_compute_ns: int | None = None  # of an execution: the device's own time (None on the CPU)
    trace: str = ""  # of a traced execution: its span's traceparent, for the worker
    worker_span: WorkerSpan | None = None  # of a traced execution: the worker's span, from its answer


class InferResult(NamedTuple):
    """A request's answer: its model version's outputs and, from an execution, where its time went. A named
    tuple, not a frozen dataclass: one is made for every request on the daemon's thread, and the dataclass
    took twice as long to make (1.4 against 0.65 us on the 2-core VM). None for `timings`: an answer no
    execution gave (the response cache's, an ensemble's)."""

    model: str
    version: int
    outputs: tuple[OutputTensor, ...]
    timings: Timings | None = None
