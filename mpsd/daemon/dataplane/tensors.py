"""What the execution channel asks of its caller: an execution's tensors (laid out, written and read by the
caller, `marshal`) and where its time went (`request.Timings`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

from mpsd.ipc import protocol as p

T_co = TypeVar("T_co", covariant=True)


class Tensors(Protocol[T_co]):
    """One execution's tensors, laid out, written and read by the caller (`marshal`): the
    channel provides the seat's regions and calls these while it holds the seat."""

    @property
    def refs(self) -> tuple[p.TensorRef, ...]:
        """Each input's place in the input region, as `lay_out` set it."""
        ...

    @property
    def sequence(self) -> tuple[tuple[int, bool], ...]:
        """A sequence model's rows: each one's sequence slot and start flag (empty for other models)."""
        ...

    def lay_out(self) -> int:
        """Place the inputs; returns the input region's size they need (control block included)."""
        ...

    def write(self, buf: memoryview, place: Place | None) -> tuple[p.Piece, ...]:
        """Copy the inputs into the input region, except the bytes `place` finds in an arena the worker
        has mapped: those are returned, for the worker to read in place."""
        ...

    def outputs(self) -> tuple[str, ...]:
        """The outputs to compute."""
        ...

    def parameters(self) -> p.RequestParameters:
        """The request parameters the model reads (empty for most models)."""
        ...

    def read(self, refs: Sequence[p.TensorRef], buf: memoryview) -> T_co:
        """The results, copied out of the output region where the worker's `refs` say they are."""
        ...


Place = Callable[[memoryview], "tuple[int, int] | None"]  # (arena id, offset) of bytes the worker can read


class PhaseTimes(Protocol):
    """Where an execution's time went, in nanoseconds (`request.Timings`)."""

    worker_wait_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    device_compute_ns: int | None
    trace: str  # a traced execution's span, as a traceparent for its Infer frame ("": not traced)
    worker_span: p.WorkerSpan | None  # the worker's span of a traced execution
