"""The int32 flags kernels set on bad input (a non-finite x, an invalid code), in mapped host memory.

A call that must raise on such input reads its flag once, after its kernels: when the flag is a
word of pinned host memory mapped into the device's address space (`cuMemHostAlloc` with
`DEVICEMAP`), the kernels' store of 1 reaches the host directly, so the read is a wait for the
call's stream and a load of the word, without the 4-byte device-to-host copy a flag in device
memory needs (that copy is a separate engine operation, several microseconds in each call's
timeline on the H200). The kernels write a flag only on bad input, so the normal case sends
nothing over the host link.

`new()` hands out words from pages of `PAGE_WORDS`, allocated once and kept for the process;
a `HostFlag` returns its word when it is collected. A HostFlag is what kernels take for an
`int32[::1]` flag argument (it has `__cuda_array_interface__`). Under the simulator, and where
mapped memory cannot be had, `new()` gives a device array and callers copy it as before
(`is_host_flag` tells them apart).
"""
from __future__ import annotations

import ctypes
import threading
from typing import Any

import numpy as np

PAGE_WORDS = 1024  # int32 words per mapped page (4 KiB)
_I32 = np.dtype(np.int32)
_lock = threading.Lock()  # page making; words come and go by atomic list operations
_free: list[tuple[int, int]] = []  # (host address, device address) of words no flag holds
_pages: list[int] = []  # host addresses of the pages (kept for the process)
_mapped_ok: list[bool] = []  # [whether mapped pages can be had], decided on first use


class HostFlag:
    """One int32 word of mapped pinned memory: kernels write it through `__cuda_array_interface__`
    (a 1-element int32 array at its device address), the host reads `value` after a wait for
    the stream those kernels ran on."""

    __slots__ = ("__cuda_array_interface__", "_word", "_host", "_dev", "__weakref__")
    shape = (1,)
    size = 1
    dtype = _I32

    def __init__(self, host: int, dev: int):
        self._host, self._dev = host, dev
        self._word = ctypes.c_int32.from_address(host)
        self._word.value = 0
        self.__cuda_array_interface__ = {"data": (dev, False), "shape": (1,), "strides": None, "typestr": "<i4",
                                         "version": 3}

    @property
    def value(self) -> int:
        """The word as the host sees it (after a wait for the kernels' stream)."""
        return self._word.value

    def clear(self) -> None:
        """Set the word back to 0 (no kernel that may write it is running)."""
        self._word.value = 0

    def copy_to_host(self) -> np.ndarray:
        """The flag as a 1-element int32 array (the device arrays' spelling)."""
        return np.array([self._word.value], dtype=_I32)

    def __del__(self) -> None:
        # No lock here: the collector may run this inside `new()` on the same thread, and a list
        # append is atomic.
        try:
            _free.append((self._host, self._dev))
        except Exception:  # noqa: BLE001 - at interpreter exit the module may be gone
            pass


def _new_page() -> bool:
    """Map one more page of words into `_free`; False where mapped memory cannot be had."""
    try:
        from cuda.bindings import driver as cu
        from numba import cuda

        cuda.current_context()  # the driver calls below need a current context on this thread
        err, host = cu.cuMemHostAlloc(PAGE_WORDS * 4, cu.CU_MEMHOSTALLOC_DEVICEMAP | cu.CU_MEMHOSTALLOC_PORTABLE)
        if err != cu.CUresult.CUDA_SUCCESS:
            return False
        err, dev = cu.cuMemHostGetDevicePointer(host, 0)
        if err != cu.CUresult.CUDA_SUCCESS:
            cu.cuMemFreeHost(host)
            return False
    except Exception:  # noqa: BLE001 - no cuda-bindings, no context: device flags
        return False
    host, dev = int(host), int(dev)
    _pages.append(host)
    _free.extend((host + 4 * i, dev + 4 * i) for i in range(PAGE_WORDS))
    return True


def new() -> Any:
    """A zeroed flag: a `HostFlag` on a GPU, else a 1-element int32 device array (numba's)."""
    from numba import config

    if not config.ENABLE_CUDASIM:
        if not _mapped_ok:
            with _lock:
                if not _mapped_ok:
                    _mapped_ok.append(_new_page())
        while _mapped_ok[0]:
            try:
                host, dev = _free.pop()  # atomic: no lock (see HostFlag.__del__)
            except IndexError:
                with _lock:
                    if not _free and not _new_page():
                        break
                continue
            return HostFlag(host, dev)
    from numba import cuda

    return cuda.to_device(np.zeros(1, dtype=_I32))


def clear(flag: Any, stream: Any) -> None:
    """Set a flag back to 0 after its stream was waited for: a mapped word at once, a device
    flag by a copy in `stream`'s (a StreamRef) order."""
    if type(flag) is HostFlag:
        flag.clear()
    else:
        flag.copy_to_device(np.zeros(1, dtype=_I32), stream=stream.numba)


def is_host_flag(flag: Any) -> bool:
    """Whether `flag` came from mapped memory (read it with `.value`, no copy)."""
    return type(flag) is HostFlag


class Mark:
    """A CUDA event (timing off) recorded on a call's stream and waited for by the host: the
    point of that stream after which a flag can no longer change, or after which a call's last
    kernels are done (`Scratch.early_marks`). Recorded again by each call that uses it."""

    __slots__ = ("handle", "_cu")

    def __init__(self) -> None:
        from cuda.bindings import driver as cu
        from numba import cuda

        cuda.current_context()  # the driver calls need a current context on this thread
        err, self.handle = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if err != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuEventCreate failed: {err.name}")
        self._cu = cu

    def record(self, stream: Any) -> None:
        """Mark the end of the work enqueued so far on `stream` (a `_streams.StreamRef`)."""
        err, = self._cu.cuEventRecord(self.handle, stream.handle)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuEventRecord failed: {err.name}")

    def wait(self) -> None:
        """Block until the work before the last `record` is done."""
        err, = self._cu.cuEventSynchronize(self.handle)
        if err != self._cu.CUresult.CUDA_SUCCESS:
            from numba.cuda.cudadrv.driver import CudaAPIError

            raise CudaAPIError(err, f"waiting for a call's kernels failed: {err.name}")

    def __del__(self) -> None:
        try:
            self._cu.cuEventDestroy(self.handle)
        except Exception:  # noqa: BLE001 - at interpreter exit the driver may be gone
            pass
