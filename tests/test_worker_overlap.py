"""Two executions on the device at once: the worker's serving loop launches the next execution behind the
one running, then answers them in order.

The device is a stand-in here: CUDA cannot run on this machine, so a CPU runner is given completion
events of a test's making (`query` says "still running" until the worker waits on one). The real path on a
CUDA GPU is covered end to end by test_arena_pieces.py's GPU test (batches through fronts, CUDA graphs).
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mpsd.errors import ErrorCode
from mpsd.ipc import protocol as p
from mpsd.ipc.framing import FrameReader, encode
from mpsd.ipc.shm import Region
from mpsd.worker.inference import Runner
from mpsd.worker.serve import Serving

ROW = 16  # bytes: one FP32[4] row


class Log:
    """What happened, in order: each model call and each wait for an execution's completion."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []


class StandInCompletion:
    """Stands in for torch.cuda.Event: the execution counts as running until the worker waits for it."""

    def __init__(self, log: Log, execution: int) -> None:
        self.log, self.execution, self.waited = log, execution, False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return self.waited

    def synchronize(self) -> None:
        self.log.events.append(("wait", self.execution))
        self.waited = True


class Model:
    """Doubles its input; logs the call by the value of its first element (the execution's number)."""

    def __init__(self, log: Log) -> None:
        self.log = log

    def __call__(self, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        self.log.events.append(("call", int(inputs[0][0, 0])))
        return {"y": inputs[0] * 2}


@pytest.fixture
def seats() -> Iterator[list[Region]]:
    regions = [Region.create(1 << 16) for _ in range(2 * p.SEATS)]  # input and output of each seat
    yield regions
    for region in regions:
        region.unlink()
        region.close()


def execution(seats: list[Region], number: int, seat: int) -> p.Infer:
    inputs, outputs = seats[2 * seat], seats[2 * seat + 1]
    inputs.buf[0] = 0
    inputs.buf[p.CONTROL_BYTES : p.CONTROL_BYTES + ROW] = np.full(4, number, np.float32).tobytes()
    ref = p.TensorRef("x", "FP32", (1, 4), p.CONTROL_BYTES, ROW)
    return p.Infer(
        number,
        (ref,),
        ("y",),
        p.RegionRef(inputs.name, inputs.size),
        p.RegionRef(outputs.name, outputs.size),
        seat,
    )


def serve(log: Log, messages: list[object], overlap: bool = True, model: Model | None = None) -> list[object]:
    """Run the worker's serving loop over `messages` (ending with Shutdown); the answers it sent."""
    spec = p.ModelSpec(
        "m", 1, "python", "", 8, (p.TensorSpec("x", "FP32", (4,)),), (p.TensorSpec("y", "FP32", (4,)),)
    )
    runner = Runner(spec, model if model is not None else Model(log), torch.device("cpu"))
    if overlap:
        made = iter(range(1, 100))
        runner._completion = lambda: StandInCompletion(log, next(made))
        runner.overlaps = True
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(b"".join(encode(m) for m in messages))
        Serving(ours, runner, snapshot_interval_s=3600).run()
        ours.close()  # the worker is done: what it sent ends there
        reader = FrameReader(theirs, 5.0)
        answers: list[object] = []
        while True:
            try:
                answer = reader.recv_wait()
            except Exception:
                break
            if not isinstance(answer, p.MemorySnapshot):
                answers.append(answer)
        return answers
    finally:
        ours.close()
        theirs.close()


def outputs(seats: list[Region], seat: int, done: object) -> list[float]:
    assert isinstance(done, p.InferDone), done
    (ref,) = done.outputs
    out = seats[2 * seat + 1]
    values: list[float] = np.frombuffer(out.buf[ref.offset : ref.offset + ref.nbytes], np.float32).tolist()
    return values


def test_the_next_execution_is_launched_before_the_running_one_is_answered(seats: list[Region]) -> None:
    log = Log()
    first, second = execution(seats, 1, 0), execution(seats, 2, 1)
    answers = serve(log, [first, second, p.Shutdown()])
    # The second was queued on the device while the first ran; the first was waited for only then.
    assert log.events == [("call", 1), ("call", 2), ("wait", 1), ("wait", 2)]
    assert [(type(a), getattr(a, "req_id", None)) for a in answers] == [(p.InferDone, 1), (p.InferDone, 2)]
    assert outputs(seats, 0, answers[0]) == [2.0] * 4
    assert outputs(seats, 1, answers[1]) == [4.0] * 4


def test_one_at_a_time_without_completions(seats: list[Region]) -> None:
    """Where the device has no completion events (the CPU, MPS), each execution is answered before the
    next is launched."""
    log = Log()
    answers = serve(log, [execution(seats, 1, 0), execution(seats, 2, 1), p.Shutdown()], overlap=False)
    assert log.events == [("call", 1), ("call", 2)]
    assert [getattr(a, "req_id", None) for a in answers] == [1, 2]


def test_answers_keep_their_order_and_rows_when_one_launch_fails(seats: list[Region]) -> None:
    """An execution whose callers all went away fails at its launch; its answer still comes after the
    answer of the one that ran before it, and the one after it runs."""
    log = Log()
    first, second = execution(seats, 1, 0), execution(seats, 2, 1)
    seats[2].buf[0] = p.ABANDONED_CANCELLED  # the second's callers were cancelled before it ran
    answers = serve(log, [first, second, p.Shutdown()])
    assert [(type(a), getattr(a, "req_id", None)) for a in answers] == [(p.InferDone, 1), (p.InferFailed, 2)]
    failed = answers[1]
    assert isinstance(failed, p.InferFailed) and failed.code == ErrorCode.CANCELLED.value
    assert "cancelled" in failed.message
    assert log.events == [("call", 1), ("wait", 1)]
    assert outputs(seats, 0, answers[0]) == [2.0] * 4


class PoisonableModel(Model):
    """Doubles its input, and fails an execution whose first value is negative (as a model's error would)."""

    def __call__(self, inputs: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        if float(inputs[0][0, 0]) < 0:
            raise RuntimeError("the model failed on a negative row")
        return super().__call__(inputs)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 3),
            st.integers(0, 6).map(lambda n: n == 0),
            st.integers(0, 6).map(lambda n: n == 0),
        ),
        min_size=1,
        max_size=8,
    )
)
def test_overlapped_launches_answer_as_one_at_a_time(plan: list[tuple[int, bool, bool]]) -> None:
    """The fast path (the next execution launched behind the running one) against the plain one (each
    answered before the next is launched): the same answers, in the same order, with the same rows, for
    executions of 1-3 rows, some failing in the model, some abandoned before they run. Each execution has
    regions of its own, in seats taken in turn."""
    regions = [Region.create(1 << 12) for _ in range(2 * len(plan))]
    try:
        got = []
        for overlap in (True, False):
            messages: list[object] = []
            for k, (rows, fails, abandoned) in enumerate(plan):
                inputs, out = regions[2 * k], regions[2 * k + 1]
                inputs.buf[0] = p.ABANDONED_CANCELLED if abandoned else 0
                values = np.arange(rows * 4, dtype=np.float32) + 10 * (k + 1)
                if fails:
                    values[0] = -1
                inputs.buf[p.CONTROL_BYTES : p.CONTROL_BYTES + values.nbytes] = values.tobytes()
                out.buf[:] = bytes(out.size)
                ref = p.TensorRef("x", "FP32", (rows, 4), p.CONTROL_BYTES, values.nbytes)
                messages.append(
                    p.Infer(
                        k + 1,
                        (ref,),
                        ("y",),
                        p.RegionRef(inputs.name, inputs.size),
                        p.RegionRef(out.name, out.size),
                        k % p.SEATS,
                    )
                )
            log = Log()
            answers = serve(log, [*messages, p.Shutdown()], overlap=overlap, model=PoisonableModel(log))
            seen = []
            for k, answer in enumerate(answers):
                if isinstance(answer, p.InferDone):
                    (ref,) = answer.outputs
                    out = regions[2 * k + 1]
                    rows_out = np.frombuffer(
                        out.buf[ref.offset : ref.offset + ref.nbytes], np.float32
                    ).tolist()
                    seen.append(("done", answer.req_id, ref.shape, rows_out))
                else:
                    assert isinstance(answer, p.InferFailed), answer
                    seen.append(("failed", answer.req_id, answer.code, answer.message))
            got.append(seen)
        assert got[0] == got[1]
        assert [entry[1] for entry in got[0]] == list(range(1, len(plan) + 1))  # one answer each, in order
    finally:
        for region in regions:
            region.unlink()
            region.close()
