"""Clients' system shared-memory regions (Triton's `system_shared_memory` extension).

A registered region is the client's POSIX shared-memory object, held open by the daemon. Inputs are read
from it with `pread` straight into the worker's region when their batch is assembled, so that copy is the
only one; outputs are written into it with `pwrite`. On Linux the daemon never maps a client's object: its
owner can shrink it at any time, and touching a mapped page past the new end is a SIGBUS, which would end
the daemon. A read cut short by a shrunken object fails that request instead. macOS has no read or write
on shared-memory descriptors, but it also lets an object be sized only once, so there the region is
mapped and copied to and from. The client owns the name: mpsd
never unlinks it. A region unregistered while requests still use it stays open until the last of them has
finished.

CUDA regions (`cuda_shm`) are kept in the same registry and held by the same lease: one name space, and
one way for a request's tensors to be read and written, whichever kind of memory they are in.
"""

from __future__ import annotations

import _posixshmem
import mmap
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypeVar

from mpsd.daemon.api.call import Params
from mpsd.daemon.api.cuda_shm import CudaRegion
from mpsd.daemon.dataplane.request import OutputTensor
from mpsd.errors import AlreadyExists, InvalidArgument, NotFound
from mpsd.ipc.shm import PREFIX

SHM_REGION = "shared_memory_region"
SHM_OFFSET = "shared_memory_offset"
SHM_BYTE_SIZE = "shared_memory_byte_size"
SHM_PARAMS = frozenset({SHM_REGION, SHM_OFFSET, SHM_BYTE_SIZE})
# Map client objects instead of reading and writing their descriptors (see the module docstring).
MAP_REGIONS = sys.platform == "darwin"


@dataclass(frozen=True)
class ShmRef:
    """Where a tensor lives, as a request names it: region, offset inside it, byte size."""

    region: str
    offset: int
    byte_size: int


def _int_param(what: str, parameters: Params, key: str, default: int | None) -> int:
    if key not in parameters:
        if default is None:
            raise InvalidArgument(f"{what}: '{SHM_REGION}' needs '{key}' as well")
        return default
    number = parameters[key].integer()
    if number is None:
        raise InvalidArgument(f"{what}: parameter '{key}' must be an integer (int64_param)")
    if number < 0:
        raise InvalidArgument(f"{what}: parameter '{key}' must not be negative, got {number}")
    return number


def shm_ref(what: str, parameters: Params) -> ShmRef | None:
    """The shared-memory location a tensor's parameters give, or None when its data is in the request."""
    if SHM_PARAMS.isdisjoint(parameters):
        return None
    if SHM_REGION not in parameters:
        raise InvalidArgument(f"{what}: shared-memory parameters given without '{SHM_REGION}'")
    region = parameters[SHM_REGION]
    if region.kind != "string" or not region.value:
        raise InvalidArgument(f"{what}: parameter '{SHM_REGION}' must be a region name (string_param)")
    return ShmRef(
        str(region.value),
        _int_param(what, parameters, SHM_OFFSET, 0),
        _int_param(what, parameters, SHM_BYTE_SIZE, None),
    )


class ClientRegion:
    """One registered region: `byte_size` bytes of the client's object `key`, from `offset`."""

    def __init__(self, name: str, key: str, offset: int, byte_size: int) -> None:
        self.name = name
        self.key = key
        self.offset = offset
        self.byte_size = byte_size
        self.users = 0  # requests holding the region now
        self.retired = False  # unregistered: unmap when the last user is done
        try:
            fd = _posixshmem.shm_open(key, os.O_RDWR, 0o600)
        except OSError as exc:
            raise InvalidArgument(
                f"shared memory region '{name}': cannot open key '{key}': {exc.strerror}"
            ) from None
        except UnicodeEncodeError:  # a lone surrogate, which JSON can carry: no object has that name
            raise InvalidArgument(f"shared memory region '{name}': key {key!r} is not valid text") from None
        try:
            size = os.fstat(fd).st_size
            if offset + byte_size > size:
                raise InvalidArgument(
                    f"shared memory region '{name}': offset {offset} + byte_size {byte_size} exceeds the "
                    f"{size} bytes of key '{key}'"
                )
            self._view: memoryview | None = None  # the region, where it is mapped
            if MAP_REGIONS:
                start = offset - offset % mmap.ALLOCATIONGRANULARITY  # mmap offsets must be page-aligned
                self._mmap = mmap.mmap(fd, offset + byte_size - start, offset=start)
                self._view = memoryview(self._mmap)[offset - start :]
        except BaseException:
            os.close(fd)
            raise
        self._fd: int | None = fd

    def place(self, what: str, offset: int, nbytes: int) -> ShmSlice:
        """`nbytes` from `offset` inside the region, bounds checked (against the object's size now, too)."""
        if offset + nbytes > self.byte_size:
            raise InvalidArgument(
                f"{what}: offset {offset} + byte size {nbytes} is outside shared memory region "
                f"'{self.name}' ({self.byte_size} bytes)"
            )
        self._check_size(what)
        return ShmSlice(self, what, self.offset + offset, nbytes)

    def _check_size(self, what: str, when: str = "") -> None:
        size = os.fstat(self._open(what)).st_size
        if size < self.offset + self.byte_size:
            raise InvalidArgument(
                f"{what}: shared memory region '{self.name}' was truncated by its owner{when}: key "
                f"'{self.key}' holds {size} bytes now; register it again"
            )

    def _open(self, what: str) -> int:
        if self._fd is None:  # cannot happen while a request holds the region
            raise InvalidArgument(f"{what}: shared memory region '{self.name}' is closed")
        return self._fd

    def read_into(self, what: str, dest: memoryview, position: int) -> None:
        """Fill `dest` from `position` of the object; a short read means its owner shrank it."""
        fd, done = self._open(what), 0
        if self._view is not None:
            start = position - self.offset
            dest[:] = self._view[start : start + dest.nbytes]
            return
        try:
            while done < dest.nbytes:
                got = os.preadv(fd, [dest[done:]], position + done)
                if got <= 0:
                    self._check_size(what, " before the request ran")  # names the truncation
                    raise InvalidArgument(f"{what}: shared memory region '{self.name}' ended early")
                done += got
        except OSError as exc:
            raise InvalidArgument(f"{what}: shared memory region '{self.name}': {exc.strerror}") from None

    def write_from(self, what: str, data: bytes | memoryview, position: int) -> None:
        """Write `data` at `position` of the object (never past the region: the caller checked its size)."""
        self._check_size(what, " while the request ran")  # a shrunken object would silently grow again
        fd, view, done = self._open(what), memoryview(data).cast("B"), 0
        if self._view is not None:
            start = position - self.offset
            self._view[start : start + view.nbytes] = view
            return
        try:
            while done < view.nbytes:
                done += os.pwrite(fd, view[done:], position + done)
        except OSError as exc:
            raise InvalidArgument(f"{what}: shared memory region '{self.name}': {exc.strerror}") from None

    def close(self) -> None:
        """Close (and unmap where mapped), never unlink."""
        if self._fd is None:
            return
        os.close(self._fd)
        self._fd = None
        if self._view is not None:
            try:
                self._view.release()
                self._mmap.close()
            except BufferError:  # a copy still in progress elsewhere: unmapped when it lets go
                pass


class ShmSlice:
    """A tensor's place in a client's region: read into the worker's region when its batch is assembled
    (`read_into`), or written when its response is built (`write`)."""

    __slots__ = ("nbytes", "position", "region", "what")

    def __init__(self, region: ClientRegion, what: str, position: int, nbytes: int) -> None:
        self.region = region
        self.what = what
        self.position = position  # in the client's object
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes

    def read_into(self, dest: memoryview) -> None:
        self.region.read_into(self.what, dest, self.position)

    def write(self, data: bytes | memoryview) -> None:
        self.region.write_from(self.what, data, self.position)


class Placed(Protocol):
    """A tensor's place in a region of either kind."""

    def __len__(self) -> int: ...

    def read_into(self, dest: memoryview) -> None: ...

    def write(self, data: bytes | memoryview) -> None: ...


Region = ClientRegion | CudaRegion
R = TypeVar("R", ClientRegion, CudaRegion)
KIND_NAMES = {ClientRegion: "system", CudaRegion: "CUDA"}


class ClientShmRegistry:
    """The regions registered by name, system and CUDA ones in one name space (as Triton's: a request
    names a region whatever its kind); all use is on the event loop's thread, so no locks."""

    def __init__(self) -> None:
        self._regions: dict[str, Region] = {}

    def register(self, name: str, key: str, offset: int, byte_size: int) -> None:
        if not name:
            raise InvalidArgument("shared memory region name is empty")
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' is already registered")
        if key.lstrip("/").startswith(PREFIX):
            raise InvalidArgument(f"shared memory key '{key}' is reserved for mpsd's own tensor buffers")
        if byte_size == 0:
            raise InvalidArgument(f"shared memory region '{name}': byte_size must be positive")
        self._regions[name] = ClientRegion(name, key, offset, byte_size)

    def check_cuda_name(self, name: str) -> None:
        """A CUDA region's name must be free in the one name space (Triton's words when it is not)."""
        if name in self._regions:
            raise AlreadyExists(f"shared memory region '{name}' already in manager")

    def register_cuda(self, region: CudaRegion) -> None:
        """Add an opened CUDA region; one of its name registered meanwhile (it was opened off the event
        loop) refuses it, and it is closed."""
        try:
            self.check_cuda_name(region.name)
        except AlreadyExists:
            region.close()
            raise
        self._regions[region.name] = region

    def unregister(self, name: str, kind: type[Region] = ClientRegion) -> None:
        """Forget one region of `kind` (every one when `name` is empty); an unknown name, or one of the
        other kind, is not an error."""
        for region_name in [name] if name else list(self._regions):
            region = self._regions.get(region_name)
            if isinstance(region, kind):
                del self._regions[region_name]
                region.retired = True
                if region.users == 0:
                    region.close()

    def status(self, name: str) -> list[ClientRegion]:
        return self._of_kind(name, ClientRegion)

    def cuda_status(self, name: str) -> list[CudaRegion]:
        return self._of_kind(name, CudaRegion)

    def _of_kind(self, name: str, kind: type[R]) -> list[R]:
        if not name:
            return [r for n in sorted(self._regions) if isinstance(r := self._regions[n], kind)]
        region = self._regions.get(name)
        if region is None:
            raise NotFound(f"unable to find {KIND_NAMES[kind].lower()} shared memory region: '{name}'")
        if not isinstance(region, kind):
            raise NotFound(
                f"The region named '{name}' is registered as {KIND_NAMES[type(region)]} shared memory, "
                f"not {KIND_NAMES[kind]} shared memory"
            )
        return [region]

    def acquire(self, name: str, what: str) -> Region:
        region = self._regions.get(name)
        if region is None:
            raise InvalidArgument(f"{what}: shared memory region '{name}' is not registered")
        region.users += 1
        return region

    @staticmethod
    def release(region: Region) -> None:
        region.users -= 1
        if region.retired and region.users == 0:
            region.close()

    def lease(self) -> ShmLease:
        return ShmLease(self)


class ShmLease:
    """The regions one request uses, held from validation until its response is built."""

    def __init__(self, registry: ClientShmRegistry) -> None:
        self._registry = registry
        self._held: dict[str, Region] = {}
        self.outputs: dict[str, Placed] = {}  # output name -> where its bytes go

    def _region(self, name: str, what: str) -> Region:
        region = self._held.get(name)
        if region is None:
            region = self._registry.acquire(name, what)
            self._held[name] = region
        return region

    def input(self, what: str, ref: ShmRef, nbytes: int) -> Placed:
        """Where the input's bytes are (read later, into the worker's region); the byte size must be
        exactly shape x datatype."""
        if ref.byte_size != nbytes:
            raise InvalidArgument(
                f"{what}: {SHM_BYTE_SIZE} is {ref.byte_size} but its shape and datatype need {nbytes} bytes"
            )
        return self._region(ref.region, what).place(what, ref.offset, ref.byte_size)

    def bind_output(self, name: str, ref: ShmRef) -> None:
        what = f"output '{name}'"
        self.outputs[name] = self._region(ref.region, what).place(what, ref.offset, ref.byte_size)

    def write_outputs(self, outputs: Sequence[OutputTensor]) -> None:
        """Copy each output bound to shared memory into its place."""
        for out in outputs:
            target = self.outputs.get(out.name)
            if target is None:
                continue
            if len(out.data) > len(target):
                raise InvalidArgument(
                    f"output '{out.name}': its shared memory holds {len(target)} bytes but the result has "
                    f"{len(out.data)} bytes"
                )
            target.write(out.data)

    def __enter__(self) -> ShmLease:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.outputs.clear()
        for region in self._held.values():
            self._registry.release(region)
        self._held.clear()
