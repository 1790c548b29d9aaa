"""A fix to numba-cuda's CUDA simulator that the tests depend on (simulator only, never on a GPU).

The simulator runs each CUDA thread of a block as a Python thread and gives a block's threads
one shared-memory array per `cuda.shared.array` call site: `FakeCUDAShared.array` looks the
site up in a dict and, when absent, makes the array and stores it. Two threads that reach the
site together can both find it absent and make two arrays; the threads then disagree about which
array is the block's shared memory, and a reduction through it (a block max, a GEMV's k-lane
sum) reads values nobody wrote. It shows as rare wrong results under load (short GIL switch
intervals, busy CPUs). `install()` wraps the lookup-or-make in one lock per process, which makes
the first allocation at a site the one every thread of the block gets.
"""
from __future__ import annotations

import threading

_lock = threading.Lock()


def install() -> bool:
    """Make the simulator's shared-array allocation atomic (idempotent). Returns whether it is
    in place. The method is replaced, not wrapped: the simulator keys an allocation by its
    caller's frame, which a wrapper would hide."""
    from numba.cuda.simulator import kernelapi

    cls = kernelapi.FakeCUDAShared
    if getattr(cls.array, "_qcore_locked", False):
        return True
    cls.array = _locked_array
    return True


def _locked_array(self, shape, dtype, alignment=None):
    """`FakeCUDAShared.array` (numba-cuda 0.30) with the lookup-or-make under one lock."""
    import sys
    import traceback

    import numpy as np
    from numba.core import types
    from numba.np import numpy_support

    if alignment is not None:
        raise RuntimeError("Array alignment is not supported in cudasim")
    if isinstance(dtype, types.Type):
        dtype = numpy_support.as_dtype(dtype)
    if shape == 0:  # dynamic shared memory: one buffer for the block
        count = self._dynshared_size // np.dtype(dtype).itemsize
        return np.frombuffer(self._dynshared.data, dtype=dtype, count=count)
    caller = traceback.extract_stack(sys._getframe(), limit=2)[0][0:2]  # (file, line) of the call site
    with _lock:
        res = self._allocations.get(caller)
        if res is None:
            res = self._allocations[caller] = np.empty(shape, dtype)
    return res


_locked_array._qcore_locked = True
