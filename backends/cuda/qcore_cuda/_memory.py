"""Device out-of-memory as one clear `DeviceMemoryError`.

The backend's entry points run under `guard(...)`, which knows how many bytes the operation asks
the device for (input, payload, output). numba raises `CudaAPIError` (code 2,
CUDA_ERROR_OUT_OF_MEMORY) from whichever allocation fails; the guard turns it into an error that
names the operation, the size asked for and the device's free memory. numba has already released
its pending deallocations and retried once, and nothing is cached half-built, so the backend stays
usable: the next call that fits succeeds.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

from qcore.errors import DeviceMemoryError

__all__ = ["guard", "is_out_of_memory"]

CUDA_ERROR_OUT_OF_MEMORY = 2


def is_out_of_memory(e: BaseException) -> bool:
    """A device allocation failure (numba's CudaAPIError code 2), or host memory under the simulator."""
    if isinstance(e, MemoryError) and not isinstance(e, DeviceMemoryError):
        return True
    return getattr(e, "code", None) == CUDA_ERROR_OUT_OF_MEMORY or "CUDA_ERROR_OUT_OF_MEMORY" in str(e)


def _fmt(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _free_memory() -> str:
    try:
        from numba import cuda

        free, total = cuda.current_context().get_memory_info()
        return f"{_fmt(free)} free of {_fmt(total)}"
    except Exception:  # noqa: BLE001 - best effort, the error is raised anyway
        return "free memory unknown"


def guard(size: Callable[..., tuple[str, int]]):
    """Decorate a backend method: `size(self, *args, **kwargs)` gives (what the call does, bytes it
    needs on the device); an out-of-memory failure inside becomes `DeviceMemoryError`."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(self, *args: Any, **kwargs: Any):
            try:
                return fn(self, *args, **kwargs)
            except DeviceMemoryError:
                raise
            except Exception as e:
                if not is_out_of_memory(e):
                    raise
                try:
                    what, nbytes = size(self, *args, **kwargs)
                except Exception:  # noqa: BLE001
                    what, nbytes = fn.__name__.lstrip("_"), 0
                raise DeviceMemoryError(
                    f"cuda: out of device memory to {what}: it needs about {_fmt(nbytes)} ({nbytes} bytes) on "
                    f"the device, which has {_free_memory()}; free device arrays, split the tensor or use "
                    "another backend (the cuda backend stays usable)"
                ) from None
        return run
    return wrap
