"""Which CUDA stream a backend call runs on.

A call takes `stream=`: a numba stream, a torch or CuPy stream, or a raw `cudaStream_t` handle
(int). Without one it follows its input: a torch CUDA tensor's current torch stream, a CuPy
array's current CuPy stream; anything else runs on the default stream (handle 0, which is also
torch's and CuPy's default). `StreamRef` carries the stream in the three forms the launch paths
take: numba's (dispatcher launches, copies), cuda.core's (`cuda.core.launch`) and the raw handle
(`cuLaunchKernel`, the memory pool). They are built once per handle.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from qcore.errors import InputError


@dataclass(frozen=True)
class StreamRef:
    """One stream: `handle` (cudaStream_t as int, 0 = default), `numba` (what numba launches and
    copies take: 0 or a numba Stream), `core` (a cuda.core Stream, or None until needed)."""

    handle: int
    numba: Any
    core: Any

    def synchronize(self) -> None:
        """Wait for this stream's work (not the device's)."""
        if self.numba == 0:
            from numba import cuda

            cuda.default_stream().synchronize()
        else:
            self.numba.synchronize()


class _Default:
    """The default stream; its cuda.core form is made on first use (it needs numba-cuda)."""

    handle = 0
    numba = 0

    _core: Any = None

    @property
    def core(self):
        if self._core is None:
            from numba.cuda.cudadrv import driver

            self._core = driver._to_core_stream(0)
        return self._core

    def synchronize(self) -> None:
        from numba import cuda

        cuda.default_stream().synchronize()


DEFAULT: Any = _Default()
_refs: dict[int, StreamRef] = {}


def on(kernel: Any, cfg: tuple, s: Any) -> Any:
    """`kernel[grid, block]` on stream `s` (a StreamRef): a dispatcher launch in `s`'s order."""
    return kernel[cfg[0], cfg[1], s.numba]


def from_handle(handle: int) -> Any:
    """The StreamRef of a raw handle (0: the default stream)."""
    if handle == 0:
        return DEFAULT
    ref = _refs.get(handle)
    if ref is None:
        from numba import cuda
        from numba.cuda.cudadrv import driver

        ns = cuda.external_stream(handle)
        ref = _refs[handle] = StreamRef(handle, ns, driver._to_core_stream(ns))
    return ref


def _handle_of(stream: Any) -> int:
    """The cudaStream_t of a stream object: int, numba (`.handle`), torch (`.cuda_stream`), CuPy (`.ptr`)."""
    if isinstance(stream, int):
        return stream
    for attr in ("cuda_stream", "ptr"):
        v = getattr(stream, attr, None)
        if isinstance(v, int):
            return v
    h = getattr(stream, "handle", None)
    if h is not None:
        v = getattr(h, "value", h)  # numba's Stream.handle: a CUstream (int()-able) or ctypes value
        try:
            return int(v or 0)
        except (TypeError, ValueError):
            pass
    if hasattr(stream, "__cuda_stream__"):  # the CUDA stream protocol: (version, handle)
        return int(stream.__cuda_stream__()[1])
    raise InputError(f"stream= takes a numba, torch or CuPy stream or a cudaStream_t int, got {type(stream).__name__}; "
                     "leave it out to follow the input's stream")


_TORCH_RAW: list = []  # [torch's current-stream handle getter], looked up once


def torch_handle(device: int) -> int:
    """The handle of torch's current stream on CUDA device `device` (the stream a torch input
    follows), read without a torch Stream object where torch offers that."""
    if not _TORCH_RAW:
        torch = sys.modules["torch"]
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        _TORCH_RAW.append(raw if raw is not None else lambda d: torch.cuda.current_stream(d).cuda_stream)
    return int(_TORCH_RAW[0](device))


def torch_stream(device: int) -> Any:
    """The StreamRef of torch's current stream on CUDA device `device` (`torch_handle`)."""
    return from_handle(torch_handle(device))


def _follow(x: Any) -> int:
    """The handle of the stream a torch or CuPy input is current on (0 otherwise)."""
    mod = type(x).__module__
    if mod.startswith("torch") and "torch" in sys.modules:
        torch = sys.modules["torch"]
        if isinstance(x, torch.Tensor) and x.is_cuda:
            return torch_handle(x.get_device())
    elif mod.startswith("cupy") and "cupy" in sys.modules:
        return int(sys.modules["cupy"].cuda.get_current_stream().ptr)
    return 0


def resolve(stream: Any, x: Any = None) -> Any:
    """The StreamRef for a call: `stream` when given, else the stream of input `x`, else the default."""
    if stream is None:
        return from_handle(_follow(x)) if x is not None else DEFAULT
    if isinstance(stream, (StreamRef, _Default)):
        return stream
    from numba import config

    if config.ENABLE_CUDASIM:  # simulated streams have no handle; the simulator runs launches in order
        if not (isinstance(stream, int) or hasattr(stream, "synchronize")):
            _handle_of(stream)  # the same error as on a GPU
        return StreamRef(0, stream if hasattr(stream, "synchronize") else 0, None)
    return from_handle(_handle_of(stream))
