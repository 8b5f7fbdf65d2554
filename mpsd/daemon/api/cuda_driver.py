"""The CUDA driver API through ctypes: what the daemon needs of a client's CUDA IPC memory, without torch.

The driver's own library (libcuda.so.1) is used rather than the CUDA runtime: it comes with the NVIDIA
driver and is on the loader's path wherever a GPU can be used at all, so nothing has to find a toolkit or
a runtime whose version the driver supports, and a client's `cudaIpcMemHandle_t` is the driver's
`CUipcMemHandle`, byte for byte. Nothing is loaded, and CUDA is not initialised, until the first region is
opened: a daemon that no client hands CUDA memory never makes a CUDA context. A GPU's primary context is
held while a region on it is open, and released with the last one.

The calls block; copies run on the caller's thread, which is made current to the region's context first
(a context is current per thread).
"""

from __future__ import annotations

import ctypes
import sys
import threading

HANDLE_BYTES = 64  # sizeof(CUipcMemHandle) == sizeof(cudaIpcMemHandle_t)
_LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS, as Triton opens handles
_ERROR_NO_DEVICE = 100  # CUDA_ERROR_NO_DEVICE
_LIBRARY = "libcuda.so.1"


class CudaUnavailable(Exception):
    """This host cannot open CUDA memory at all (no driver, no GPU); the message says which."""


class CudaFailure(Exception):
    """A driver call failed; the message names the call and the driver's error."""


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]


class _Driver:
    """The loaded, initialised driver library."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        u64, ptr = ctypes.c_uint64, ctypes.c_void_p
        self._sign("cuInit", ctypes.c_uint)
        self._sign("cuGetErrorName", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._sign("cuGetErrorString", ctypes.c_int, ctypes.POINTER(ctypes.c_char_p))
        self._sign("cuDeviceGet", ctypes.POINTER(ctypes.c_int), ctypes.c_int)
        self._sign("cuDevicePrimaryCtxRetain", ctypes.POINTER(ptr), ctypes.c_int)
        self._sign("cuDevicePrimaryCtxRelease_v2", ctypes.c_int)
        self._sign("cuCtxSetCurrent", ptr)
        self._sign("cuCtxSynchronize")
        self._sign("cuIpcOpenMemHandle_v2", ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint)
        self._sign("cuIpcCloseMemHandle", u64)
        self._sign("cuMemGetAddressRange_v2", ctypes.POINTER(u64), ctypes.POINTER(ctypes.c_size_t), u64)
        self._sign("cuMemcpyDtoH_v2", ptr, u64, ctypes.c_size_t)
        self._sign("cuMemcpyHtoD_v2", u64, ptr, ctypes.c_size_t)

    def _sign(self, name: str, *argtypes: object) -> None:
        function = getattr(self.lib, name)
        function.argtypes = argtypes
        function.restype = ctypes.c_int

    def error(self, code: int) -> str:
        name, text = ctypes.c_char_p(), ctypes.c_char_p()
        if self.lib.cuGetErrorName(code, ctypes.byref(name)) != 0 or name.value is None:
            return f"CUDA error {code}"
        self.lib.cuGetErrorString(code, ctypes.byref(text))
        described = (text.value or b"").decode(errors="replace")
        return f"{name.value.decode(errors='replace')}: {described}"

    def call(self, name: str, *args: object) -> None:
        code = getattr(self.lib, name)(*args)
        if code != 0:
            raise CudaFailure(f"{name} failed ({self.error(code)})")


_lock = threading.Lock()
_loaded: _Driver | None = None


def _driver() -> _Driver:
    """The driver, loaded and initialised once; CudaUnavailable where this host has none to use."""
    global _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        if sys.platform != "linux":
            raise CudaUnavailable(f"CUDA is not available on {sys.platform}")
        try:
            lib = ctypes.CDLL(_LIBRARY)
        except OSError as exc:
            raise CudaUnavailable(f"no CUDA driver on this host ({exc})") from None
        try:
            driver = _Driver(lib)
        except AttributeError as exc:  # a driver older than CUDA 11 lacks some of the calls
            raise CudaUnavailable(f"the CUDA driver is too old ({exc})") from None
        code = lib.cuInit(0)
        if code == _ERROR_NO_DEVICE:
            raise CudaUnavailable(f"the CUDA driver finds no GPU ({driver.error(code)})")
        if code != 0:
            raise CudaUnavailable(f"the CUDA driver cannot be initialised ({driver.error(code)})")
        _loaded = driver
        return driver


class IpcMemory:
    """Another process's device allocation, opened from its IPC handle on GPU `device` (this process's
    numbering, as CUDA_VISIBLE_DEVICES leaves it): `size` bytes from its start. The driver counts opens of
    one handle, so one allocation may be opened for several regions and closed for each."""

    def __init__(self, handle: bytes, device: int) -> None:
        if len(handle) != HANDLE_BYTES:
            raise CudaFailure(f"a CUDA IPC handle has {HANDLE_BYTES} bytes, got {len(handle)}")
        driver = self._driver = _driver()
        ordinal, context = ctypes.c_int(), ctypes.c_void_p()
        driver.call("cuDeviceGet", ctypes.byref(ordinal), device)
        driver.call("cuDevicePrimaryCtxRetain", ctypes.byref(context), ordinal)
        self._device, self._context = ordinal.value, context
        self._pointer = 0
        self._open = True
        try:
            driver.call("cuCtxSetCurrent", context)
            pointer, ipc = ctypes.c_uint64(), _IpcHandle.from_buffer_copy(handle)  # all 64 bytes, NULs too
            driver.call("cuIpcOpenMemHandle_v2", ctypes.byref(pointer), ipc, _LAZY_ENABLE_PEER_ACCESS)
            self._pointer = pointer.value
            base, size = ctypes.c_uint64(), ctypes.c_size_t()
            driver.call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), pointer)
            self.size = size.value - (self._pointer - base.value)
        except BaseException:
            self.close()
            raise

    def _current(self) -> _Driver:
        if not self._open:
            raise CudaFailure("the CUDA memory is closed")
        self._driver.call("cuCtxSetCurrent", self._context)
        return self._driver

    def to_host(self, offset: int, address: int, nbytes: int) -> None:
        """Copy `nbytes` from `offset` of the device memory to host `address`."""
        self._current().call("cuMemcpyDtoH_v2", ctypes.c_void_p(address), self._pointer + offset, nbytes)

    def to_device(self, offset: int, address: int, nbytes: int) -> None:
        """Copy `nbytes` from host `address` to `offset` of the device memory, finished on return: from
        pageable memory the copy returns once the bytes are staged, and the owner reads them next."""
        driver = self._current()
        driver.call("cuMemcpyHtoD_v2", self._pointer + offset, ctypes.c_void_p(address), nbytes)
        driver.call("cuCtxSynchronize")

    def close(self) -> None:
        """Unmap the memory (the owner's allocation is untouched) and let go of the GPU's context, which
        the driver destroys with its last user."""
        if not self._open:
            return
        self._open = False
        try:
            if self._pointer:
                self._driver.call("cuCtxSetCurrent", self._context)
                self._driver.call("cuIpcCloseMemHandle", self._pointer)
        finally:
            self._driver.call("cuDevicePrimaryCtxRelease_v2", self._device)
