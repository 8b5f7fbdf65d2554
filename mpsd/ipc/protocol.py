"""Messages exchanged between the daemon and one worker over that worker's private socket.

Only small control messages travel here; tensor bytes live in shared memory regions owned by the daemon
and are described by `TensorRef` (offset and length inside a region).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


@dataclass(frozen=True)
class Infer:
    """One execution. The daemon may send the next before this one is answered (at most `SLOTS` in flight):
    each uses the regions of its own slot, and the worker runs them in order."""

    req_id: int
    inputs: tuple[TensorRef, ...]
    outputs: tuple[str, ...]
    input_region: RegionRef
    output_region: RegionRef
    slot: int = 0
    sent_ns: int = 0  # time.monotonic_ns() when the daemon sent it (a clock both processes share)


SLOTS = 2
# The first CONTROL_BYTES of every input region are its slot's control block. Byte 0 is 0 when the daemon
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


# worker -> daemon


@dataclass(frozen=True)
class Ready:
    pid: int
    device: dict[str, object]
    load_ms: float
    warmup_ms: float
    cuda_graphs: tuple[int, ...] = ()  # the batch sizes CUDA graphs were recorded at
    cuda_graphs_ms: float = 0.0


@dataclass(frozen=True)
class LoadFailed:
    reason: str


@dataclass(frozen=True)
class NeedOutput:
    """The outputs of request `req_id` need `nbytes`, more than the current output region holds."""

    req_id: int
    nbytes: int


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


@dataclass(frozen=True)
class StreamPart:
    """One response of a decoupled model's request `req_id`, in its slot's output region. The worker waits
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


ToWorker = Init | Infer | OutputRegion | StreamAck | Shutdown
FromWorker = Ready | LoadFailed | NeedOutput | StreamPart | InferDone | InferFailed | MemorySnapshot
