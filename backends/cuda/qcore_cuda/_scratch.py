"""`Scratch`: a backend's persistent device scratch, its non-finite flag and the waits on them.

The quantize kernels accumulate statistics (sum |x|, the tensor's max |x|, a two-level global)
in a few words of device memory that persist between calls, and set an int32 flag on a
non-finite x (`_flags.new`: mapped host memory on a GPU). A call reads its flag once, after a
wait for its own stream (`read_flag`); a two-pass fast quantize on the default stream may
instead wait for its max pass alone and return while the codes are written (`early_marks`),
in which case the next call on another stream first waits for that call's last kernels
(`buffers`). After a flagged input or an interrupted call the scratch is dropped and made anew
(`drop`).
"""
from __future__ import annotations

import functools
import threading
from typing import Any, NamedTuple

import numpy as np

from qcore.spec.checks import raise_nonfinite

from . import _array, _flags
from ._compat import numba_cuda

__all__ = ["Scratch", "ScratchBuffers", "sync_stream", "check_cu"]


def sync_stream(handle: int) -> tuple:
    """`cuStreamSynchronize` (looked up on the first call)."""
    global sync_stream
    from cuda.bindings import driver as cu

    sync_stream = cu.cuStreamSynchronize
    return sync_stream(handle)


def check_cu(err: Any, what: str) -> None:
    """Raise numba's CudaAPIError for a failed driver call (`err` from cuda-bindings)."""
    if err:  # not CUDA_SUCCESS
        from numba.cuda.cudadrv.driver import CudaAPIError

        raise CudaAPIError(err, f"{what} failed: {err.name}")


class ScratchBuffers(NamedTuple):
    """The zeroed device scratch the quantize kernels share (`Scratch.buffers`)."""

    asum: Any  # float64[1]: sum |x| (absmean calibration)
    stats: Any  # float32[4]: [g, max statistic, amax, -]; k_quant / k_zero_stats zero it after use
    flag: Any  # int32[1] non-finite flag (`_flags.new`); set only on an error, then the scratch is remade


class Scratch:
    """One backend's scratch buffers and flags, and the host's waits on them (module text).
    Nothing is allocated until the first `buffers` call."""

    def __init__(self) -> None:
        self._buffers: ScratchBuffers | None = None
        self._tail_mark: Any = None  # `_flags.Mark` after an early call's last kernels
        self._tail_stream: int | None = None  # the handle of the stream that call ran on, until waited for

    @functools.cached_property
    def _local(self) -> threading.local:
        """Per-thread state: the pinned word a flag is read into, the last flag's address, the
        flag mark of an early call."""
        return threading.local()

    @functools.cached_property
    def act_sink(self) -> Any:
        """A device int32 flag the kernels may set and nothing reads: the non-finite flag of a
        quantize that does not wait to check x (`act`'s rows of NaN instead, docs/spec.md,
        quantized activations)."""
        return numba_cuda().to_device(np.zeros(1, np.int32))

    @property
    def tail_mark(self) -> Any:
        """The `_flags.Mark` recorded after an early call's last kernels (None before the first)."""
        return self._tail_mark

    def buffers(self, s: Any = None) -> ScratchBuffers:
        """The persistent zeroed scratch (`ScratchBuffers`). A call on stream `s` (None: unknown)
        first waits for the kernels of an earlier call that returned before them on another
        stream (`early_marks`)."""
        if self._tail_stream is not None:
            self.wait_tail(s)
        scr = self._buffers
        if scr is None:
            z = numba_cuda().to_device(np.zeros(3, dtype=np.float64))
            scr = self._buffers = ScratchBuffers(z[0:1], z[1:3].view(np.float32), _flags.new())
        return scr

    def drop(self, s: Any = None) -> None:
        """Forget the scratch (after a flagged input or an interrupted call), once no kernel can
        still be using it: the call's stream `s` (None: the last early call's tail) is waited for."""
        if s is not None and not _array._simulated():
            check_cu(sync_stream(s.handle)[0], "waiting for a call's stream")
        self.wait_tail(None)
        self._buffers = None

    def early_marks(self, caller_x: bool, s: Any) -> tuple | None:
        """(flag mark, tail mark) for a two-pass fast quantize that may return before its last
        kernels finish, or None. The max pass (`fast.k_amax`) sees every x and flags any NaN or
        infinity, and the quantize pass flags only what it flagged, so the non-finite flag is
        final after the max pass: the call records the flag mark there and waits for it alone,
        while the quantize pass and the statistics reset run on (the scratch stays busy until
        the tail mark, which `buffers` makes a call on another stream wait for). Only on the
        default stream, which the backend's own reads of a result (`into_data`, `to_numpy`)
        follow, so a result is never read half written; for x in the caller's memory (`caller_x`:
        no temporary to free under the running kernels); and with a mapped flag (the simulator's
        and copied flags wait for the stream)."""
        if s.handle != 0 or not caller_x or type(self.buffers(s).flag) is not _flags.HostFlag:
            return None
        loc = self._local
        flag_mark = getattr(loc, "flag_mark", None)
        if flag_mark is None:
            flag_mark = loc.flag_mark = _flags.Mark()
        if self._tail_mark is None:
            self._tail_mark = _flags.Mark()
        self._tail_stream = s.handle
        return flag_mark, self._tail_mark

    def wait_tail(self, s: Any = None) -> None:
        """Wait for the last kernels of a call that returned before them (`early_marks`) unless
        they ran on stream `s` (None: any stream), whose order covers them."""
        tail = self._tail_stream
        if tail is not None and (s is None or s.handle != tail):
            self._tail_mark.wait()
            self._tail_stream = None

    def read_flag(self, flag: Any, s: Any, ready: Any = None) -> int:
        """An int32 flag (non-finite input, invalid code) after a wait for the call's stream
        alone (not the device), or only up to `ready` (a `_flags.Mark` after which the flag is
        final: `early_marks`): a mapped host word (`_flags.HostFlag`) is read in place; a device
        flag takes one 4-byte asynchronous copy into this thread's pinned word first."""
        if type(flag) is _flags.HostFlag:  # mapped memory: the kernels' store is already here
            if ready is not None:
                ready.wait()
            else:
                check_cu(sync_stream(s.handle)[0], "waiting for a call's stream")
            return flag.value
        if _array._simulated():
            return int(flag.copy_to_host()[0])
        loc = self._local
        host = getattr(loc, "host", None)
        if host is None:
            from cuda.bindings import driver as cu

            host = loc.host = numba_cuda().pinned_array(1, dtype=np.int32)
            loc.word, loc.copy = host.ctypes.data, cu.cuMemcpyDtoHAsync
        last = getattr(loc, "last", None)
        if last is None or last[0] is not flag:  # the flag's address, read again only for another flag
            last = loc.last = (flag, flag.__cuda_array_interface__["data"][0])
        check_cu(loc.copy(loc.word, last[1], 4, s.handle)[0], "reading a device flag")
        check_cu(sync_stream(s.handle)[0], "waiting for a call's stream")
        return int(host[0])

    def raise_if_flagged(self, flag: Any, xd: Any, shape: tuple, s: Any, ready: Any = None) -> None:
        """InputError naming x's first non-finite element when the call's flag is set (read after
        the stream, or after `ready`: `read_flag`); the scratch is dropped first."""
        if self.read_flag(flag, s, ready):
            self.drop(s)  # fresh scratch (and flag) for the next call
            host = xd.copy_to_host() if hasattr(xd, "copy_to_host") else numba_cuda().as_cuda_array(xd).copy_to_host()
            raise_nonfinite(host.reshape(shape))
