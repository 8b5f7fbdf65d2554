"""Supervision of one instance on fake worker handles: no processes, no torch, no sleeping. The instance's
sleep and clock are injected, so each test asserts the back-off delays the supervisor chose and runs in
milliseconds. Real workers dying, hanging and being recycled: test_worker_crash, test_faults, test_limits."""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import Awaitable, Callable

import pytest

from mpsd.daemon.dataplane.lane import Lane
from mpsd.daemon.supervise.instance import Instance, SupervisorSettings
from mpsd.daemon.supervise.restart import STABLE_AFTER_S, Backoff
from mpsd.daemon.supervise.worker.process import WorkerLaunch
from mpsd.errors import LoadError
from mpsd.ipc.protocol import SEATS, ModelSpec
from mpsd.net import gather
from mpsd.net.gather import GatheringSelector

LAUNCH = WorkerLaunch(ModelSpec("m", 1, "torchscript", "/nowhere", 8, (), ()), 0, "KIND_CPU", None, {})
SETTINGS = SupervisorSettings(backoff_initial_s=0.5, backoff_max_s=2.0, stop_timeout_s=1.0)
_pids = itertools.count(100)


class FakeWorker:
    """A worker handle whose life the test decides."""

    def __init__(self, fails: bool) -> None:
        self.pid = next(_pids)
        self.died = asyncio.Event()
        self.over_ceiling = asyncio.Event()
        self.exit_description = "ended (status unknown)"
        self.ceiling_reason = ""
        self.fails = fails
        self.started = self.stopped = self.killed = False
        self.channel = self  # its executions' channel, as the lane sees it

    @property
    def refusing(self) -> bool:
        return self.died.is_set()

    overlaps = False

    async def start(self, timeout_s: float) -> object:
        if self.fails:
            raise LoadError("model file is broken")
        self.started = True
        return "ready"

    async def stop(self, timeout_s: float) -> None:
        self.stopped = True
        self.died.set()

    async def kill(self) -> None:
        self.killed = True
        self.died.set()

    def crash(self, how: str = "exit code 1") -> None:
        self.exit_description = how
        self.died.set()


class Rig:
    """One instance wired to fakes: its workers, queue, executions, clock and sleep."""

    def __init__(self, instances: int = 1) -> None:
        self.made: list[FakeWorker] = []
        self.failures = 0  # how many of the next starts fail
        self.batches: asyncio.Queue[str] = asyncio.Queue()
        self.requeued: list[str] = []
        self.runs: list[tuple[str, FakeWorker]] = []
        self.running = 0
        self.most_running = 0
        self.execution_gate = asyncio.Event()
        self.execution_gate.set()
        self.downs = 0
        self.now = 1000.0
        self.sleeps: list[float] = []
        self.sleep_gate = asyncio.Event()
        self.sleep_gate.set()
        self.lane: Lane[str, FakeWorker] = Lane(self, self.execute, lambda: self.lanes, self.instance_down)
        self.lanes = [self.lane] * instances  # the version's lanes, as `Lane` sees them
        self.instance: Instance[FakeWorker] = Instance(
            LAUNCH, SETTINGS, self.new_worker, self.lane, sleep=self.sleep, clock=lambda: self.now
        )

    def new_worker(self, launch: WorkerLaunch) -> FakeWorker:
        assert launch is LAUNCH
        worker = FakeWorker(fails=self.failures > 0)
        self.failures = max(0, self.failures - 1)
        self.made.append(worker)
        return worker

    async def next_batch(self, partial: Callable[[], bool] | None = None) -> str:
        return await self.batches.get()

    def __len__(self) -> int:
        return self.batches.qsize()

    last_batch_full = True  # its batches leave full: full lanes let the loop gather

    def wake(self) -> None:
        pass

    def requeue(self, batch: str) -> None:
        self.requeued.append(batch)

    async def gather(self, batch: str) -> str:
        return f"{batch}+joined"  # what arrived while it gathered

    async def execute(self, batch: str, worker: FakeWorker) -> None:
        self.runs.append((batch, worker))
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            await self.execution_gate.wait()
        finally:
            self.running -= 1

    def instance_down(self) -> None:
        self.downs += 1

    async def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        await self.sleep_gate.wait()
        self.now += seconds


async def until(condition: Callable[[], bool]) -> None:
    """Let the event loop run until `condition` holds (a few hundred turns at most: no wall-clock waits)."""
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0)
    raise AssertionError("condition never held")


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 5.0))


# ---- the back-off policy ---------------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap_and_comes_back_after_a_stable_run() -> None:
    backoff = Backoff(0.5, 4.0, stable_after_s=30.0)
    backoff.started(0.0)
    backoff.ended(1.0)
    assert [backoff.delay() for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    backoff.started(10.0)
    backoff.ended(39.0)  # ran 29 s: not stable yet
    assert backoff.delay() == 4.0
    backoff.started(50.0)
    backoff.ended(81.0)  # ran 31 s
    assert [backoff.delay() for _ in range(3)] == [0.5, 1.0, 2.0]


def test_backoff_judges_stability_once_per_end_so_failed_attempts_keep_doubling() -> None:
    backoff = Backoff(1.0, 60.0)
    backoff.started(0.0)
    backoff.ended(STABLE_AFTER_S + 1)
    assert [backoff.delay() for _ in range(4)] == [1.0, 2.0, 4.0, 8.0]  # attempts that never start


# ---- one instance on fake workers -----------------------------------------------------------------------


def test_start_makes_the_instance_ready_and_its_worker_runs_the_batches() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        (worker,) = rig.made
        assert worker.started and rig.instance.worker is worker
        assert rig.instance.ready and rig.instance.state == "ready"
        assert rig.instance.started_at == rig.now
        rig.batches.put_nowait("b1")
        await until(lambda: len(rig.runs) == 1)
        assert rig.runs == [("b1", worker)]
        await rig.instance.stop()

    run(scenario)


@pytest.mark.parametrize(("instances", "depth"), [(1, SEATS), (2, 1)])
def test_a_lone_instance_keeps_its_worker_seats_busy_and_one_of_several_takes_a_batch_at_a_time(
    instances: int, depth: int
) -> None:
    async def scenario() -> None:
        rig = Rig(instances)
        rig.execution_gate.clear()
        await rig.instance.start()
        for name in ("b1", "b2", "b3"):
            rig.batches.put_nowait(name)
        await until(lambda: len(rig.runs) == depth)
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(rig.runs) == depth and rig.most_running == depth
        rig.execution_gate.set()
        await until(lambda: len(rig.runs) == 3)
        assert rig.most_running == depth
        await rig.instance.stop()

    run(scenario)


@pytest.mark.parametrize(("instances", "depth"), [(1, SEATS), (2, 1)])
def test_a_direct_execution_needs_an_idle_instance_and_counts_toward_the_depth(
    instances: int, depth: int
) -> None:
    """A request runs in its own task only on an idle instance. While it runs, the next requests queue: a
    lone instance's dispatcher may still send one more batch behind it (its depth), one of several may not
    and gives the batch it took back."""

    async def scenario() -> None:
        rig = Rig(instances)
        rig.execution_gate.clear()
        await rig.instance.start()
        for _ in range(50):  # the dispatcher starts and waits for a batch
            await asyncio.sleep(0)
        worker = rig.lane.direct_channel()
        assert worker is rig.made[0]
        direct = asyncio.create_task(rig.lane.run_direct("d0", worker))
        await until(lambda: rig.running == 1)
        assert rig.lane.direct_channel() is None  # busy: the next request queues
        rig.batches.put_nowait("queued")  # the dispatcher was already waiting for it
        if depth > 1:
            await until(lambda: rig.running == 2)  # behind the direct execution, in the worker
        else:
            await until(lambda: rig.requeued == ["queued"])
        for _ in range(50):
            await asyncio.sleep(0)
        assert rig.most_running == depth
        assert rig.runs[0] == ("d0+joined", rig.made[0])  # with what joined it while it gathered
        rig.execution_gate.set()
        await direct
        await until(lambda: rig.lane.direct_channel() is rig.made[0])  # idle again
        rig.batches.put_nowait("next")
        await until(lambda: rig.runs[-1] == ("next", rig.made[0]))
        await rig.instance.stop()
        assert rig.lane.direct_channel() is None

    run(scenario)


def test_a_crash_restarts_the_worker_after_the_backoff_delay() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        rig.sleep_gate.clear()
        rig.made[0].crash("killed by signal 9 (SIGKILL)")
        await until(lambda: rig.sleeps == [0.5])
        assert rig.instance.state == "restarting" and not rig.instance.ready
        assert rig.instance.last_exit == "killed by signal 9 (SIGKILL)"
        assert rig.downs == 1
        assert len(rig.made) == 1  # nothing started before the delay is over
        rig.sleep_gate.set()
        await until(lambda: rig.instance.ready)
        assert len(rig.made) == 2 and rig.instance.worker is rig.made[1]
        assert rig.instance.restarts == 1 and rig.instance.last_error is None
        assert rig.instance.started_at == 1000.5
        rig.batches.put_nowait("after")
        await until(lambda: len(rig.runs) == 1)
        assert rig.runs == [("after", rig.made[1])]  # the new worker gets the work
        await rig.instance.stop()

    run(scenario)


def test_a_start_that_fails_during_a_restart_is_retried_after_a_longer_delay() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        rig.failures = 1
        rig.sleep_gate.clear()
        rig.made[0].crash()
        await until(lambda: len(rig.sleeps) == 1)
        rig.sleep_gate.set()  # wakes the sleep under way only: the next one waits again
        rig.sleep_gate.clear()
        await until(lambda: len(rig.sleeps) == 2)
        failed = rig.made[1]
        assert failed.killed and not failed.started  # a start that failed leaves nothing running
        assert rig.instance.last_error == "model file is broken"
        assert rig.instance.state == "restarting" and rig.instance.restarts == 0
        rig.sleep_gate.set()
        await until(lambda: rig.instance.ready)
        assert rig.sleeps == [0.5, 1.0]
        assert rig.instance.worker is rig.made[2] and rig.instance.restarts == 1
        assert rig.instance.last_error is None
        await rig.instance.stop()

    run(scenario)


def test_backoff_doubles_to_the_cap_across_failed_starts_and_resets_after_a_stable_run() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        rig.failures = 3
        rig.made[-1].crash()
        await until(lambda: rig.instance.ready and rig.instance.restarts == 1)
        assert rig.sleeps == [0.5, 1.0, 2.0, 2.0]  # capped at backoff_max_s
        rig.now += STABLE_AFTER_S - 1  # not stable yet: the delay stays where it was
        rig.made[-1].crash()
        await until(lambda: rig.instance.restarts == 2)
        assert rig.sleeps[4:] == [2.0]
        rig.now += STABLE_AFTER_S + 1  # a healthy run: forgiven
        rig.made[-1].crash()
        await until(lambda: rig.instance.restarts == 3)
        assert rig.sleeps[5:] == [0.5]
        assert rig.downs == 3 and len(rig.made) == 7
        await rig.instance.stop()

    run(scenario)


def test_stop_stops_the_running_worker_and_ends_supervision() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        worker = rig.made[0]
        await rig.instance.stop()
        assert worker.stopped and rig.instance.state == "stopped"
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(rig.made) == 1 and rig.sleeps == []  # the stop's end is not a crash to recover from
        rig.batches.put_nowait("late")
        for _ in range(50):
            await asyncio.sleep(0)
        assert rig.runs == []

    run(scenario)


def test_stop_during_the_backoff_delay_starts_no_worker() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        rig.sleep_gate.clear()
        rig.made[0].crash()
        await until(lambda: rig.sleeps == [0.5])
        await rig.instance.stop()
        rig.sleep_gate.set()
        for _ in range(50):
            await asyncio.sleep(0)
        assert len(rig.made) == 1 and rig.instance.state == "stopped"

    run(scenario)


def test_a_worker_over_its_memory_ceiling_hands_over_to_a_warm_replacement() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        old = rig.made[0]
        rig.execution_gate.clear()
        rig.batches.put_nowait("running")
        await until(lambda: rig.running == 1)
        old.ceiling_reason = "RSS 300 bytes above the ceiling of 200"
        old.over_ceiling.set()
        await until(lambda: len(rig.made) == 2)
        new = rig.made[1]
        await until(lambda: new.started)
        for _ in range(50):
            await asyncio.sleep(0)
        assert not old.stopped and rig.instance.worker is old  # the batch it runs finishes there first
        assert rig.lane.direct_channel() is None  # nothing new starts on the old worker
        rig.execution_gate.set()
        await until(lambda: old.stopped)
        assert rig.instance.worker is new and rig.instance.ready
        assert rig.instance.recycles == 1 and rig.instance.restarts == 0
        assert rig.sleeps == [] and rig.downs == 0  # a hand-over, not a restart
        rig.batches.put_nowait("next")
        await until(lambda: len(rig.runs) == 2)
        assert rig.runs == [("running", old), ("next", new)]
        await rig.instance.stop()
        assert new.stopped

    run(scenario)


def test_a_replacement_that_fails_to_start_leaves_the_old_worker_serving() -> None:
    async def scenario() -> None:
        rig = Rig()
        await rig.instance.start()
        old = rig.made[0]
        rig.failures = 1
        old.over_ceiling.set()
        await until(lambda: len(rig.made) == 2 and rig.made[1].killed)
        assert rig.instance.worker is old and not old.stopped and rig.instance.recycles == 0
        rig.batches.put_nowait("b")
        await until(lambda: len(rig.runs) == 1)
        assert rig.runs == [("b", old)]
        old.crash()  # and when it ends, it is restarted as any other
        await until(lambda: rig.instance.restarts == 1)
        assert rig.instance.worker is rig.made[2] and rig.sleeps == [0.5]
        await rig.instance.stop()

    run(scenario)


def _selector() -> GatheringSelector:
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    assert isinstance(selector, GatheringSelector)
    return selector


def test_a_lone_instance_with_both_seats_busy_lets_its_loop_gather_until_one_frees() -> None:
    """With every lane of the version full, a request that arrives now waits for a worker's answer, which
    wakes the loop at once: the lane tells the loop (`net/gather.py`), which gathers until it no longer is."""

    async def scenario() -> None:
        rig = Rig(1)
        rig.execution_gate.clear()
        await rig.instance.start()
        rig.batches.put_nowait("b1")
        await until(lambda: rig.running == 1)
        assert not _selector().gathers()  # room for one more in the worker
        rig.batches.put_nowait("b2")
        await until(lambda: rig.running == SEATS)
        assert _selector().gathers()
        rig.last_batch_full = False  # what arrives would fill a short batch: the loop takes it in at once
        assert not _selector().gathers()
        rig.execution_gate.set()
        await until(lambda: rig.lane.direct_channel() is not None)  # idle
        assert not _selector().gathers()
        await rig.instance.stop()

    gather.run(scenario(), 0.0, 0.001)


def test_a_full_lane_beside_one_with_room_lets_no_loop_gather() -> None:
    """One of two instances busy: the other would take a request that arrives now, so nothing is held."""

    async def scenario() -> None:
        rig, other = Rig(2), Rig(2)
        rig.lanes = other.lanes = [rig.lane, other.lane]
        rig.execution_gate.clear()
        other.execution_gate.clear()
        await rig.instance.start()
        await other.instance.start()
        rig.batches.put_nowait("b1")
        await until(lambda: rig.running == 1)
        assert rig.lane.full and not _selector().gathers()
        other.batches.put_nowait("b2")
        await until(lambda: other.running == 1)
        assert _selector().gathers()
        rig.execution_gate.set()
        other.execution_gate.set()
        await until(lambda: None is not rig.lane.direct_channel() and None is not other.lane.direct_channel())
        assert not _selector().gathers()
        await rig.instance.stop()
        await other.instance.stop()

    gather.run(scenario(), 0.0, 0.001)


def test_the_version_is_expected_to_ease_when_its_first_lane_is_due_to_answer() -> None:
    """A full version's backlog eases when the oldest execution of one of its lanes ends: it started being
    the oldest at a known time, and an execution has typically been the oldest for so long. The loop stops
    gathering a wait's length before then (`net/gather.py`). The lanes' clocks are the test's."""

    async def scenario() -> None:
        rig, other = Rig(2), Rig(2)
        rig.lanes = other.lanes = [rig.lane, other.lane]
        now = [100.0]
        rig.lane._clock = other.lane._clock = lambda: now[0]
        await rig.instance.start()
        await other.instance.start()
        rig.execution_gate.clear()
        other.execution_gate.clear()
        rig.batches.put_nowait("b1")  # takes 3 s, from 100 to 103
        await until(lambda: rig.running == 1)
        now[0] = 103.0
        rig.execution_gate.set()
        await until(lambda: rig.lane.direct_channel() is not None)  # idle
        rig.execution_gate.clear()
        assert rig.lane.eases_at == math.inf, "nothing runs"
        now[0] = 110.0
        rig.batches.put_nowait("b2")
        await until(lambda: rig.running == 1)
        now[0] = 111.0
        other.batches.put_nowait("b3")  # the other's first: how long it takes is not known
        await until(lambda: other.running == 1)
        assert rig.lane.backlogged and rig.lane.eases_at == other.lane.eases_at == 113.0  # b2's: 110 + 3
        other.lane._typical_s = 1.0  # as if it had run one before
        assert rig.lane.eases_at == 112.0  # b3's end is due first now: 111 + 1
        alone: Lane[str, FakeWorker] = Lane(rig, rig.execute, list, rig.instance_down)  # in no version
        assert not alone.backlogged and alone.eases_at == math.inf
        rig.execution_gate.set()
        other.execution_gate.set()
        await until(lambda: rig.running == other.running == 0)
        await rig.instance.stop()
        await other.instance.stop()

    run(scenario)
