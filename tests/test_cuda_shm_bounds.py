"""A CUDA shared-memory region's bounds, without a GPU (api/cuda_shm.py on a fake of the driver's opened
allocation): a tensor's offset must lie inside the region (an offset at or past its end is refused as
Triton words it, even for a tensor of no bytes), and its offset plus byte size must not pass the end; a
byte_size larger than the allocation is refused at registration."""

from __future__ import annotations

import pytest

from mpsd.daemon.api import cuda_shm
from mpsd.daemon.api.cuda_shm import CudaRegion
from mpsd.errors import InvalidArgument

ALLOCATED = 4096


class FakeIpcMemory:
    """What the CUDA driver opens from an IPC handle: an allocation of ALLOCATED bytes."""

    def __init__(self, handle: bytes, device: int) -> None:
        self.size = ALLOCATED
        self.closed = False

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def region(monkeypatch: pytest.MonkeyPatch) -> CudaRegion:
    monkeypatch.setattr(cuda_shm, "IpcMemory", FakeIpcMemory)
    return CudaRegion("r", bytes(64), 0, byte_size=256)


def test_a_tensor_inside_the_region_is_placed(region: CudaRegion) -> None:
    whole = region.place("input 'x'", 0, 256)
    assert (whole.offset, len(whole)) == (0, 256)
    last = region.place("input 'x'", 255, 1)
    assert (last.offset, len(last)) == (255, 1)
    empty = region.place("input 'x'", 255, 0)
    assert len(empty) == 0


@pytest.mark.parametrize("offset", [256, 257, 10_000])
@pytest.mark.parametrize("nbytes", [0, 4])
def test_an_offset_at_or_past_the_end_is_refused(region: CudaRegion, offset: int, nbytes: int) -> None:
    with pytest.raises(InvalidArgument) as raised:
        region.place("input 'x'", offset, nbytes)
    assert raised.value.message == "input 'x': Invalid offset for shared memory region: 'r'"


@pytest.mark.parametrize(("offset", "nbytes"), [(0, 257), (255, 2), (128, 129)])
def test_a_tensor_past_the_end_is_refused(region: CudaRegion, offset: int, nbytes: int) -> None:
    with pytest.raises(InvalidArgument) as raised:
        region.place("output 'y'", offset, nbytes)
    assert raised.value.message == "output 'y': Invalid offset + byte size for shared memory region: 'r'"


def test_a_byte_size_beyond_the_allocation_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    opened: list[FakeIpcMemory] = []

    def open_memory(handle: bytes, device: int) -> FakeIpcMemory:
        opened.append(FakeIpcMemory(handle, device))
        return opened[-1]

    monkeypatch.setattr(cuda_shm, "IpcMemory", open_memory)
    with pytest.raises(InvalidArgument, match=f"byte_size {ALLOCATED + 1} exceeds the {ALLOCATED} bytes"):
        CudaRegion("big", bytes(64), 0, byte_size=ALLOCATED + 1)
    assert [m.closed for m in opened] == [True]  # what was opened is closed again
