"""Clients' CUDA shared-memory regions (Triton's `cuda_shared_memory` extension).

A client registers device memory it allocated by its CUDA IPC handle (`cudaIpcGetMemHandle`, what
`tritonclient.utils.cuda_shared_memory` makes). The daemon opens the handle through the CUDA driver
(`cuda_driver`, no torch) and copies between the client's device memory and host memory: an input straight
into the worker's region when its batch is assembled, as a system shared-memory input is read, and an
output from its result. To the data plane a region's tensor is one more `Deferred`. The client owns the
allocation; unregistering unmaps it, never frees it, and a region unregistered while requests still use
it stays open until the last of them has finished.

Answers follow Triton's shared memory manager, word for word where it has them, with the reason added
where Triton logs it and answers only 'invalid args'.
"""

from __future__ import annotations

import asyncio
import base64
import binascii

import structlog

from mpsd.daemon.api.cuda_driver import HANDLE_BYTES, CudaFailure, CudaUnavailable, IpcMemory
from mpsd.daemon.dataplane.arenas import address
from mpsd.errors import InvalidArgument

log = structlog.get_logger("mpsd.daemon.api.cuda_shm")

BAD_HANDLE = "'raw_handle' must be a valid base64 encoded cudaIpcMemHandle_t"


def raw_handle(b64: object) -> bytes:
    """The handle an HTTP register request carries as `{"b64": ...}`."""
    if not isinstance(b64, str):
        raise InvalidArgument(BAD_HANDLE)
    try:
        return base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidArgument(BAD_HANDLE) from None


class CudaRegion:
    """One registered region: the first `byte_size` bytes of a client's allocation on GPU `device_id`."""

    def __init__(self, name: str, handle: bytes, device_id: int, byte_size: int) -> None:
        self.name = name
        self.device_id = device_id
        self.byte_size = byte_size
        self.users = 0  # requests holding the region now
        self.retired = False  # unregistered: unmap when the last user is done
        try:
            self._memory: IpcMemory | None = IpcMemory(handle, device_id)
        except CudaUnavailable as exc:
            raise InvalidArgument(
                f"failed to register CUDA shared memory region: '{name}', GPUs not supported: {exc}"
            ) from None
        except CudaFailure as exc:
            raise InvalidArgument(
                f"failed to register shared memory region: invalid args: CUDA IPC handle of region '{name}' "
                f"cannot be opened on device {device_id}: {exc}"
            ) from None
        allocated = self._memory.size
        if byte_size > allocated:
            self.close()
            raise InvalidArgument(
                f"failed to register shared memory region '{name}': invalid args: byte_size {byte_size} "
                f"exceeds the {allocated} bytes of the CUDA allocation"
            )

    def place(self, what: str, offset: int, nbytes: int) -> CudaSlice:
        """`nbytes` from `offset` inside the region, bounds checked as Triton does."""
        if offset >= self.byte_size:
            raise InvalidArgument(f"{what}: Invalid offset for shared memory region: '{self.name}'")
        if offset + nbytes > self.byte_size:
            raise InvalidArgument(
                f"{what}: Invalid offset + byte size for shared memory region: '{self.name}'"
            )
        return CudaSlice(self, what, offset, nbytes)

    def memory(self, what: str) -> IpcMemory:
        if self._memory is None:  # cannot happen while a request holds the region
            raise InvalidArgument(f"{what}: CUDA shared memory region '{self.name}' is closed")
        return self._memory

    def close(self) -> None:
        """Unmap the client's memory (its allocation stays the client's)."""
        memory, self._memory = self._memory, None
        if memory is not None:
            memory.close()


class CudaSlice:
    """A tensor's place in a client's CUDA region: copied into the worker's region when its batch is
    assembled (`read_into`), or from its result when its response is built (`write`)."""

    __slots__ = ("nbytes", "offset", "region", "what")

    def __init__(self, region: CudaRegion, what: str, offset: int, nbytes: int) -> None:
        self.region = region
        self.what = what
        self.offset = offset
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def _failed(self, exc: CudaFailure) -> InvalidArgument:
        return InvalidArgument(f"{self.what}: CUDA shared memory region '{self.region.name}': {exc}")

    def read_into(self, dest: memoryview) -> None:
        if not dest.nbytes:
            return
        try:
            self.region.memory(self.what).to_host(self.offset, address(dest), dest.nbytes)
        except CudaFailure as exc:
            raise self._failed(exc) from None

    def write(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        if not view.nbytes:
            return
        try:
            self.region.memory(self.what).to_device(self.offset, address(view), view.nbytes)
        except CudaFailure as exc:
            raise self._failed(exc) from None


async def open_region(name: str, handle: bytes, device_id: int, byte_size: int) -> CudaRegion:
    """Open a region off the event loop (the first one makes a CUDA context: up to a second); a caller
    that goes away meanwhile leaves nothing open."""
    if len(handle) != HANDLE_BYTES:
        raise InvalidArgument(BAD_HANDLE)
    opening = asyncio.ensure_future(asyncio.to_thread(CudaRegion, name, handle, device_id, byte_size))
    try:
        return await asyncio.shield(opening)
    except asyncio.CancelledError:
        opening.add_done_callback(_close_if_opened)
        raise


def _close_if_opened(task: asyncio.Future[CudaRegion]) -> None:
    if not task.cancelled() and task.exception() is None:
        task.result().close()
