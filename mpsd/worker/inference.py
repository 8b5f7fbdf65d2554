"""Turning shared-memory bytes into tensors, running the model and writing the outputs back.

All device work happens on the calling thread (MPS is not thread-safe).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from mpsd.errors import Internal
from mpsd.ipc.protocol import ModelSpec, Piece, RequestParameters, TensorRef, TensorSpec
from mpsd.ipc.shm import Region
from mpsd.ipc.strings import DATATYPE as STRINGS
from mpsd.worker import strings
from mpsd.worker.backends import Backend
from mpsd.worker.backends.base import call
from mpsd.worker.completions import Completion
from mpsd.worker.device import completion, execution_timer, synchronize
from mpsd.worker.device_time import ExecutionTimer
from mpsd.worker.dtypes import TO_TORCH, datatype_of
from mpsd.worker.regions import Arenas
from mpsd.worker.strings import StringTensor, Value

# An output on the host, ready for the output region.
HostOutput = torch.Tensor | StringTensor


@dataclass(frozen=True)
class OutputMismatch:
    """An output that does not match its config, and what the model returned instead: another datatype,
    or (with the configured one) a shape the dims do not allow."""

    output: str
    message: str
    datatype: str | None = None
    shape: tuple[int, ...] | None = None


def output_mismatch(spec: TensorSpec, tensor: Value, batched: bool) -> OutputMismatch | None:
    """How the tensor differs from the configured output, or None when it matches."""
    got_type = datatype_of(tensor)
    if got_type != spec.datatype:
        message = f"output '{spec.name}': model returned {got_type}, config says {spec.datatype}"
        return OutputMismatch(spec.name, message, datatype=got_type)
    expected = ((-1,) if batched else ()) + spec.dims
    shape = tuple(tensor.shape)
    if len(shape) != len(expected) or any(e != -1 and e != s for e, s in zip(expected, shape, strict=True)):
        message = (
            f"output '{spec.name}': model returned shape {list(shape)}, config dims {list(spec.dims)}"
            + (" (plus the batch dimension)" if batched else "")
        )
        return OutputMismatch(spec.name, message, shape=shape)
    return None


def check_output(spec: TensorSpec, tensor: Value, batched: bool) -> str | None:
    """Why the tensor does not match the configured output, or None when it does."""
    mismatch = output_mismatch(spec, tensor, batched)
    return None if mismatch is None else mismatch.message


@dataclass
class Launch:
    """An execution whose work is queued on the device: its outputs (device tensors, valid once the work
    is done), the host time its inputs took, when the model call began, and its timer. With `copy_out`,
    also its requested outputs on their way to the host, and the completion that says they have arrived."""

    outputs: dict[str, Value]
    input_ns: int
    started_ns: int
    timer: ExecutionTimer | None
    host: list[HostOutput] | None = None
    done: Completion | None = None
    waited_ns: int = 0  # from the daemon's sending to the launch


# The set of output (name, dtype, shape) already checked against the config is bounded: a model whose
# output shapes vary without end is checked every time past this many.
CHECKED_LIMIT = 1024
# Views kept per region: past this many (shapes that vary without end) the cache starts again.
VIEWS_LIMIT = 256
Views = dict[object, torch.Tensor]


def region_view(region: Region, views: Views, offset: int, nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor on bytes [offset, offset + nbytes) of the region, made once per place and kept in
    `views` (which the region cache empties before the region is unmapped)."""
    key = (offset, nbytes)
    view = views.get(key)
    if view is None:
        if len(views) >= VIEWS_LIMIT:
            views.clear()
        # Through numpy, whose array holds a buffer export for as long as the view lives: the region then
        # cannot be unmapped under it (torch.frombuffer keeps no export, so nothing would stop that).
        view = torch.from_numpy(np.frombuffer(region.buf, dtype=np.uint8, count=nbytes, offset=offset))
        views[key] = view
    return view


class Runner:
    """Runs requests for one loaded model on one device.

    Called under `torch.inference_mode()`, which the serving loop enters once. What repeats from request
    to request (tensor views on shared memory, output checks) is built once and reused: a request then costs
    a few tensor operations beyond the model itself.
    """

    def __init__(self, spec: ModelSpec, backend: Backend, device: torch.device) -> None:
        self.spec = spec
        self.backend = backend
        self.device = device
        self._on_cpu = device.type == "cpu"
        # On CUDA, inputs go to the device on a stream of their own, which the model's stream waits for:
        # the next execution's copies then run while the current one computes (`overlaps`).
        on_cuda = device.type == "cuda"
        self._copies = torch.cuda.Stream(device) if on_cuda else None  # type: ignore[no-untyped-call]
        self._outputs = {o.name: o for o in spec.outputs}
        self._batched = spec.max_batch_size > 0
        self._checked: set[tuple[str, torch.dtype, tuple[int, ...]]] = set()
        # One timer for each execution that can be on the device at once (`overlaps`); None on the CPU.
        self._timers = (execution_timer(device), execution_timer(device))
        self._turn = 0
        self._completion = completion(device)
        # Whether the next execution may be launched while this one runs: only where outputs can be copied
        # to the host behind the model's work and their arrival awaited alone (CUDA). Elsewhere reading one
        # execution's outputs waits for everything queued on the device, the next execution too.
        self.overlaps = self._completion is not None and not spec.decoupled

    def _input(self, region: Region, views: Views, ref: TensorRef) -> Value:
        if ref.datatype == STRINGS:  # made anew each time: the model may keep or change them
            return strings.to_array(region.buf[ref.offset : ref.offset + ref.nbytes], ref.shape)
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=TO_TORCH[ref.datatype], device=self.device)
        key = (ref.offset, ref.nbytes, ref.datatype, ref.shape)
        typed = views.get(key)
        if typed is None:
            flat = region_view(region, views, ref.offset, ref.nbytes)  # may start the cache again
            typed = views[key] = flat.view(TO_TORCH[ref.datatype]).reshape(ref.shape)
        if self._on_cpu:
            return typed.detach()  # the model gets its own tensor object: in-place shape changes stay its own
        return typed.to(self.device, non_blocking=True)

    def inputs(
        self,
        region: Region,
        refs: Sequence[TensorRef],
        views: Views,
        pieces: Sequence[Piece] = (),
        arenas: Arenas | None = None,
    ) -> list[Value]:
        """The execution's inputs (`_inputs`); on CUDA copied on the copy stream, the model's stream made to
        wait for them, and each tensor marked as used there (its memory is not reused before that use)."""
        if self._copies is None:
            return self._inputs(region, refs, views, pieces, arenas)
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._copies):
            tensors = self._inputs(region, refs, views, pieces, arenas)
            copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
            copied.record()
        compute.wait_event(copied)
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                tensor.record_stream(compute)
        return tensors

    def _inputs(
        self,
        region: Region,
        refs: Sequence[TensorRef],
        views: Views,
        pieces: Sequence[Piece] = (),
        arenas: Arenas | None = None,
    ) -> list[Value]:
        """The execution's inputs: views of the input region (zero-copy on the CPU), with the pieces that
        are in fronts' arenas taken from there. On a CUDA device each piece goes to the device by DMA from
        the (page-locked) arena and the rest from the region; elsewhere the pieces are copied into the
        region first."""
        if not pieces or arenas is None:
            return [self._input(region, views, r) for r in refs]
        if self.device.type != "cuda":
            buf = region.buf
            for piece in pieces:
                arena_buf = arenas.regions[piece.arena_id].buf
                buf[piece.dst : piece.dst + piece.nbytes] = arena_buf[piece.src : piece.src + piece.nbytes]
            return [self._input(region, views, r) for r in refs]
        by_input: dict[int, list[Piece]] = {}
        for piece in pieces:
            by_input.setdefault(piece.input, []).append(piece)
        host = region_view(region, views, 0, region.size)
        inputs: list[Value] = []
        for i, ref in enumerate(refs):
            mine = by_input.get(i)
            if not mine:
                inputs.append(self._input(region, views, ref))
                continue
            tensor = torch.empty(ref.shape, dtype=TO_TORCH[ref.datatype], device=self.device)
            flat = tensor.view(-1).view(torch.uint8)
            base, at, end = ref.offset, ref.offset, ref.offset + ref.nbytes  # in the region's layout
            for piece in mine:  # in the order of their places
                if piece.dst > at:  # bytes the daemon wrote into the region
                    flat[at - base : piece.dst - base].copy_(host[at : piece.dst], non_blocking=True)
                arena = _arena_bytes(arenas, piece.arena_id)
                start = piece.dst - base
                flat[start : start + piece.nbytes].copy_(
                    arena[piece.src : piece.src + piece.nbytes], non_blocking=True
                )
                at = piece.dst + piece.nbytes
            if at < end:
                flat[at - base :].copy_(host[at:end], non_blocking=True)
            inputs.append(tensor)
        return inputs

    def launch(
        self,
        region: Region,
        refs: Sequence[TensorRef],
        views: Views,
        pieces: Sequence[Piece] = (),
        arenas: Arenas | None = None,
        parameters: RequestParameters = (),
    ) -> Launch:
        """Build the inputs (zero-copy on the CPU) and call the model. On a device that runs the model
        asynchronously its work is queued when this returns; on the CPU it is done."""
        t0 = time.perf_counter_ns()
        inputs = self.inputs(region, refs, views, pieces, arenas)
        t1 = time.perf_counter_ns()
        timer = self._timers[self._turn]
        self._turn ^= 1
        try:
            if timer is not None:
                timer.start()
            outputs = call(self.backend, inputs, parameters)
            if timer is not None:
                timer.stop()
        except BaseException:
            # Copies from the (page-locked) region may still be running: let them finish before the region
            # can be reused or unmapped. A failing device must not hide the model's error.
            with contextlib.suppress(Exception):
                synchronize(self.device)
            raise
        return Launch(outputs, t1 - t0, t1, timer)

    def copy_out(self, launch: Launch, names: Sequence[str]) -> None:
        """Queue the requested outputs' copies to the host behind the model's work, then the completion
        that `finish` waits for (`overlaps` devices only): the next execution may then be queued at once,
        and overwrite its buffers (a CUDA graph's outputs) after these copies have read them."""
        assert self._completion is not None, "copy_out needs a device with completions"
        try:
            launch.host = self.prepare_outputs(launch.outputs, names, non_blocking=True)
            launch.done = self._completion()
            launch.done.record()
        except BaseException:
            with contextlib.suppress(Exception):
                synchronize(self.device)
            raise

    def finish(self, launch: Launch) -> tuple[dict[str, Value], int, int, int | None]:
        """Wait for the execution's work; returns its outputs, the input and infer times on the host, and
        the device's own time for the model call (None on the CPU). The infer time includes whatever the
        host did between launching and finishing, where that lasted longer than the device's work."""
        if launch.done is not None:
            launch.done.synchronize()
        else:
            synchronize(self.device)
        t2 = time.perf_counter_ns()
        # Past the wait both timing events are complete: reading them waits for nothing.
        device_ns = launch.timer.elapsed_ns() if launch.timer is not None else None
        return launch.outputs, launch.input_ns, t2 - launch.started_ns, device_ns

    def compute_stream(
        self,
        region: Region,
        refs: Sequence[TensorRef],
        views: Views,
        pieces: Sequence[Piece] = (),
        arenas: Arenas | None = None,
        parameters: RequestParameters = (),
    ) -> Generator[dict[str, Value], None, None]:
        """A decoupled model's responses, each on the host's side of a synchronize; closing this closes the
        model's generator. The inputs stay views of the region, which the seat holds until the request
        ends."""
        stream = getattr(self.backend, "stream", None)
        if stream is None:
            raise Internal(f"backend {type(self.backend).__name__} cannot stream responses")
        inputs = self.inputs(region, refs, views, pieces, arenas)
        parts = stream(inputs, dict(parameters)) if parameters else stream(inputs)
        try:
            for outputs in parts:
                synchronize(self.device)
                yield outputs
        finally:
            parts.close()
            with contextlib.suppress(Exception):
                synchronize(self.device)

    def prepare_outputs(
        self, outputs: dict[str, Value], names: Sequence[str], non_blocking: bool = False
    ) -> list[HostOutput]:
        """Requested outputs as contiguous CPU tensors (strings serialized), each checked against its
        config. `non_blocking`: the copies from the device are only queued (into page-locked memory), valid
        once they are done."""
        prepared: list[HostOutput] = []
        for name in names:
            tensor = outputs[name]
            if not isinstance(tensor, torch.Tensor):
                problem = check_output(self._outputs[name], tensor, self._batched)
                if problem is not None:
                    raise Internal(problem)
                prepared.append(StringTensor.of(tensor))
                continue
            seen = (name, tensor.dtype, tuple(tensor.shape))
            if seen not in self._checked:
                problem = check_output(self._outputs[name], tensor, self._batched)
                if problem is not None:
                    raise Internal(problem)
                if len(self._checked) < CHECKED_LIMIT:
                    self._checked.add(seen)
            if not self._on_cpu:
                # Contiguous on the device: a queued copy cannot be made contiguous on the host.
                tensor = tensor.contiguous().to("cpu", non_blocking=non_blocking)
            prepared.append(tensor.contiguous())
        return prepared


def _arena_bytes(arenas: Arenas, arena_id: int) -> torch.Tensor:
    """The whole arena as a uint8 tensor, made once (through numpy: its buffer export keeps the mapping
    alive as long as the tensor)."""
    tensor = arenas.bytes.get(arena_id)
    if tensor is None:
        buf = arenas.regions[arena_id].buf
        tensor = arenas.bytes[arena_id] = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
    return tensor


def host_nbytes(outputs: Sequence[HostOutput]) -> int:
    """The bytes `write_outputs` writes."""
    return sum(t.nbytes if isinstance(t, StringTensor) else t.numel() * t.element_size() for t in outputs)


def write_outputs(
    region: Region, names: Sequence[str], tensors: Sequence[HostOutput]
) -> tuple[TensorRef, ...]:
    """Copy each (contiguous CPU) output into the region once, back to back, and describe where it went.

    The copy is a plain memcpy on this thread. torch's `copy_` would split a large one over its CPU thread
    team, whose threads then spin for milliseconds waiting for more work: on a 16-core host that cost tens
    of ms of CPU per 600 KB output.
    """
    refs = []
    offset = 0
    buf = region.buf
    for name, tensor in zip(names, tensors, strict=True):
        if isinstance(tensor, StringTensor):
            nbytes = tensor.nbytes
            buf[offset : offset + nbytes] = tensor.data
            refs.append(TensorRef(name, STRINGS, tensor.shape, offset, nbytes))
            offset += nbytes
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes:
            buf[offset : offset + nbytes] = tensor.reshape(-1).view(torch.uint8).numpy().data
        refs.append(TensorRef(name, datatype_of(tensor), tuple(tensor.shape), offset, nbytes))
        offset += nbytes
    return tuple(refs)
