"""Messages exchanged between the daemon and one worker over that worker's private socket.

Only small control messages travel here; tensor bytes live in shared memory regions owned by the daemon
and are described by `TensorRef` (offset and length inside a region). The one exception are the tensors of
a python model's calls to other models (`Call`), which travel inline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

# Exit codes are part of the protocol: the supervisor treats "failed to load" differently from a crash.
EXIT_OK = 0
EXIT_LOAD_FAILED = 3
EXIT_PARENT_GONE = 4
EXIT_PROTOCOL_ERROR = 5


@dataclass(frozen=True)
class TensorSpec:
    """A configured input or output: protocol datatype and dims without the batch dimension."""

    name: str
    datatype: str
    dims: tuple[int, ...]
    optional: bool = False


@dataclass(frozen=True)
class WarmupTensor:
    """One input of a configured warm-up sample: full shape (batch dimension included), zeros or random."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    random: bool = False


@dataclass(frozen=True)
class WarmupSample:
    """A configured warm-up request, run `count` times before Ready; inputs in config order."""

    name: str
    inputs: tuple[WarmupTensor, ...]
    count: int = 1


# A request's own parameters, (name, value) pairs sorted by name: what a python model reads
# (`infer(inputs, parameters)`), hashable so that requests batch together only when theirs are equal.
RequestParameters = tuple[tuple[str, bool | int | float | str], ...]


@dataclass(frozen=True)
class StateSpec:
    """An implicit state of a sequence model: taken as input `input_name`, returned as output `output_name`,
    kept by the worker per sequence slot; at a sequence's start it is zeros, or `initial` (raw bytes)."""

    input_name: str
    output_name: str
    datatype: str
    dims: tuple[int, ...]
    initial: bytes | None = None


@dataclass(frozen=True)
class BucketSpec:
    """A bucketed input dim (`shape_buckets`): `input` is its index in ModelSpec.inputs, `dim` counts the
    batch dimension (when batching) as 0, and `sizes` are what the daemon pads it to."""

    input: int
    dim: int
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ModelSpec:
    """Everything a worker needs to load one version of a model."""

    name: str
    version: int
    backend: str
    model_path: str
    max_batch_size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    parameters: dict[str, str] = field(default_factory=dict)
    allow_pickle: bool = False
    warmup: tuple[WarmupSample, ...] = ()  # none configured: one request of zeros
    cuda_graph_batch_sizes: tuple[int, ...] = ()  # record CUDA graphs at these sizes (on a CUDA device)
    # Shared objects and Python files or packages that register custom ops, loaded before the model in this
    # order: absolute paths the daemon has checked (inside the model's folder or an allowed directory)
    op_libraries: tuple[str, ...] = ()
    autocast: str | None = None  # "float16" or "bfloat16": the forward runs under torch.autocast
    decoupled: bool = False  # infer yields responses: each goes back as a StreamPart, acknowledged in turn
    # torch.compile at load: its mode ("default", "reduce-overhead", ...), None when off; `compile_dynamic`
    # is torch.compile's `dynamic`; warm-up compiles at `compile_batch_sizes` (none: the one warm-up request)
    compile_mode: str | None = None
    compile_dynamic: bool | None = None
    compile_batch_sizes: tuple[int, ...] = ()
    # Sequence batching: its control inputs come after the config's in `inputs`; a sequence model gets no
    # warm-up of zeros (a row of zero controls is not a request of any sequence), and its states are kept here
    sequence: bool = False
    states: tuple[StateSpec, ...] = ()
    dynamic_batching: bool = False  # configured (a Triton python model's config shows it to the model)
    # Shape buckets: warm-up (and CUDA graphs) cover each size; the mask input, the daemon's, is the last of
    # `inputs` and marks the positions of `buckets[mask_follows]` (-1: no mask input)
    buckets: tuple[BucketSpec, ...] = ()
    mask_follows: int = -1


@dataclass(frozen=True)
class RegionRef:
    """A shared-memory region by name; the worker attaches on first sight of a new name."""

    name: str
    size: int


@dataclass(frozen=True)
class TensorRef:
    """A tensor stored in a region: where its bytes start and how many there are."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


# daemon -> worker


@dataclass(frozen=True)
class ArenaRef:
    """A front's arena that the worker maps from an inherited descriptor, to read request bytes in place."""

    arena_id: int
    fd: int
    size: int


class Piece(NamedTuple):
    """Bytes of an execution's input that are in a front's arena, not in the seat's input region: the worker
    takes `nbytes` from offset `src` of arena `arena_id` for input `input` (its index), to stand at offset
    `dst` of the input region's layout (the region's bytes there are not written). A named tuple: the daemon
    makes one per request of a batch on its thread, and the Infer frame carries them as plain integers."""

    input: int
    arena_id: int
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class ForgetArena:
    """The arena's front is gone: the worker unmaps it (no execution refers to it any more)."""

    arena_id: int


@dataclass(frozen=True)
class Init:
    model: ModelSpec
    instance: int
    kind: str
    memory_fraction: float | None
    heartbeat_interval_s: float = 1.0
    snapshot_after_request: bool = False  # memory ceilings are set: report right after each request
    # "mps": Triton's mps accelerator on a KIND_GPU or KIND_AUTO group: MPS where usable, else CUDA, else the
    # CPU, where plain KIND_GPU would fail (the devices passed over are reported with their reasons)
    accelerator: str | None = None
    arenas: tuple[ArenaRef, ...] = ()


@dataclass(frozen=True)
class Infer:
    """One execution. The daemon may send the next before this one is answered (at most `SEATS` in flight):
    each uses the regions of its own seat, and the worker runs them in order."""

    req_id: int
    inputs: tuple[TensorRef, ...]
    outputs: tuple[str, ...]
    input_region: RegionRef
    output_region: RegionRef
    seat: int = 0  # the execution's seat: which regions it uses (not a sequence slot, see `sequence`)
    sent_ns: int = 0  # time.monotonic_ns() when the daemon sent it (a clock both processes share)
    requests: int = 1  # client requests batched into this execution (a profile's request window counts them)
    pieces: tuple[Piece, ...] = ()  # input bytes the worker reads from fronts' arenas in place
    # The request parameters a python model reads (`infer(inputs, parameters)`), the same for every request
    # of the batch (requests with other parameters are never batched with them); empty for other models.
    parameters: RequestParameters = ()
    # A sequence model's execution (sequence batching): each row's sequence slot and whether it starts its
    # sequence, for the implicit state the worker keeps per slot. Empty for every other model.
    sequence: tuple[tuple[int, bool], ...] = ()
    # A traced execution's span as a W3C traceparent: the worker answers with its own span under it
    # (InferDone.span). Empty when the execution is not traced.
    trace: str = ""


SEATS = 2  # executions a worker holds at once, each in its own seat (input and output regions)
# The first CONTROL_BYTES of every input region are its seat's control block. Byte 0 is 0 when the daemon
# sends the execution and is set once nobody waits for it any more; the worker reads it just before running
# the execution and answers InferFailed instead of running it, or marks it STARTED and runs it (the daemon
# then lets it finish).
CONTROL_BYTES = 64
ABANDONED_CANCELLED = 1  # every request of the batch was cancelled
ABANDONED_EXPIRED = 2  # every request of the batch is past its deadline
STARTED = 3  # the worker runs it: a deadline that passes now no longer skips it


@dataclass(frozen=True)
class OutputRegion:
    """Answer to NeedOutput: a larger region for the outputs of the request in progress."""

    region: RegionRef


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class StartProfile:
    """Profile the executions from now until `requests` requests have run (0: no request limit) or the
    daemon sends StopProfile (its time window ends), whichever comes first. The worker starts between
    executions and answers ProfileStarted (or ProfileFailed); when the window ends it sends ProfileChunk
    frames and ProfileDone."""

    profile_id: int
    requests: int = 0
    mps_gpu_trace: bool = False  # MPS: also a Metal GPU trace (torch.mps.profiler.metal_capture)


@dataclass(frozen=True)
class StopProfile:
    """End the profile now (the client went away, or the daemon stops the worker); the worker still answers
    with ProfileDone, which the daemon may ignore."""

    profile_id: int


# worker -> daemon


@dataclass(frozen=True)
class Ready:
    pid: int
    device: dict[str, object]
    load_ms: float
    warmup_ms: float
    cuda_graphs: tuple[int, ...] = ()  # the batch sizes CUDA graphs were recorded at
    cuda_graphs_ms: float = 0.0
    compile_ms: float | None = None  # torch.compile (optimization.compile): the compiling warm-up's time
    calls_models: bool = True  # the model may call other models (a python model that takes `models`)
    overlaps: bool = False  # an execution may be launched behind the one running on the device (CUDA)
    frozen_objects: int = 0  # what its start-up made, frozen out of the collector's scans (`mpsd.heap`)


@dataclass(frozen=True)
class LoadFailed:
    reason: str


@dataclass(frozen=True)
class NeedOutput:
    """The outputs of request `req_id` need `nbytes`, more than the current output region holds."""

    req_id: int
    nbytes: int


@dataclass(frozen=True)
class WorkerSpan:
    """The worker's span of a traced execution, made under the span its Infer named (`Infer.trace`), for the
    daemon to export: its ids and its wall-clock times (time.time_ns())."""

    trace_id: int
    span_id: int
    parent_id: int
    start_ns: int
    end_ns: int


@dataclass(frozen=True)
class InferDone:
    req_id: int
    outputs: tuple[TensorRef, ...]
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    waited_ns: int = 0  # from `Infer.sent_ns` until the worker started it (behind the execution before it)
    # The device's own time for the model call (timing events on CUDA and MPS); None on the CPU.
    device_compute_ns: int | None = None
    span: WorkerSpan | None = None  # a traced execution's (Infer.trace)


@dataclass(frozen=True)
class StreamPart:
    """One response of a decoupled model's request `req_id`, in its seat's output region. The worker waits
    for the StreamAck before it reuses the region or resumes the model: one unacknowledged part at a time.
    The request ends with InferDone (no outputs: the final flag) or InferFailed."""

    req_id: int
    index: int  # 0, 1, ... in the order the model yielded them
    outputs: tuple[TensorRef, ...]


@dataclass(frozen=True)
class InferFailed:
    req_id: int
    code: str
    message: str


@dataclass(frozen=True)
class MemorySnapshot:
    """Sent by the worker unprompted, at most every few seconds: device memory counters and RSS."""

    memory: dict[str, int]


@dataclass(frozen=True)
class StreamAck:
    """The daemon has copied part `index` of request `req_id` out of the region; `stop`: nobody wants more,
    so the model's generator is closed instead of resumed."""

    req_id: int
    index: int
    stop: bool = False


@dataclass(frozen=True)
class ProfileStarted:
    profile_id: int
    kind: str  # "torch" (a Chrome trace follows) or "mps" (os_signposts; see ProfileDone.notes)


@dataclass(frozen=True)
class ProfileFailed:
    """The profile could not start, or failed while it ran; nothing more comes for it."""

    profile_id: int
    reason: str


PROFILE_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ProfileChunk:
    """Up to PROFILE_CHUNK_BYTES of the result, in order: `name` is "trace.json" (Chrome trace) or a Metal
    GPU trace's file name."""

    profile_id: int
    name: str
    data: bytes


@dataclass(frozen=True)
class ProfileDone:
    profile_id: int
    requests: int  # requests run in the window
    executions: int
    seconds: float
    ended_by: str  # "seconds", "requests" or "stopped"
    notes: tuple[str, ...] = ()  # what the client should know (MPS: how to see the signposts)


# A python model's calls to other models (mpsd.worker.calls): the worker sends Call from inside an execution,
# the daemon runs it as a request of the target model and answers CallDone (or CallFailed); a stream's
# responses come as CallPart, each acknowledged with CallAck before the next is sent, and end with CallDone.
# Tensors travel inline, in the frame: a call's inputs, or one answer's outputs, stay below MAX_CALL_BYTES.

MAX_CALL_BYTES = 60 * 1024 * 1024  # under the frame limit (framing.MAX_MESSAGE), with room for the rest


@dataclass(frozen=True)
class CallTensor:
    """A tensor of a call, its bytes inline: numbers in the datatype's little-endian layout, strings
    serialized (each a 4-byte length, then its bytes)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True)
class Call:
    """Infer `model` (version "" for the latest ready one) for the execution `req_id` in progress (0 while
    the worker loads: refused); `stream`: the responses of a decoupled model, one CallPart each."""

    call_id: int
    req_id: int
    model: str
    version: str
    inputs: tuple[CallTensor, ...]
    outputs: tuple[str, ...] = ()  # none: every output of the model
    stream: bool = False
    timeout_us: int = 0  # the call's own limit (microseconds from now), within the execution's deadline
    request_id: str = ""
    trace: str = ""  # the calling execution's span as a W3C traceparent (its Infer frame's); "": not traced


@dataclass(frozen=True)
class CallAck:
    """The model took the call's latest part: the daemon may send the next; `stop`: it wants no more."""

    call_id: int
    stop: bool = False


@dataclass(frozen=True)
class CallPart:
    """One response of a streamed call."""

    call_id: int
    outputs: tuple[CallTensor, ...]


@dataclass(frozen=True)
class CallDone:
    """The call's answer (for a stream: its end, with no outputs)."""

    call_id: int
    outputs: tuple[CallTensor, ...] = ()


@dataclass(frozen=True)
class CallFailed:
    """The call failed with the status and message a client would have got."""

    call_id: int
    code: str
    message: str


ToWorker = (
    Init
    | Infer
    | OutputRegion
    | StreamAck
    | Shutdown
    | StartProfile
    | StopProfile
    | CallPart
    | CallDone
    | CallFailed
)
FromWorker = (
    Ready
    | LoadFailed
    | NeedOutput
    | StreamPart
    | InferDone
    | InferFailed
    | MemorySnapshot
    | ProfileStarted
    | ProfileFailed
    | ProfileChunk
    | ProfileDone
    | Call
    | CallAck
)
