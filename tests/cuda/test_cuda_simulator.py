"""The fix qcore applies to numba-cuda's CUDA simulator (qcore_cuda/_simfix.py): the threads of a
block that reach a `cuda.shared.array` call site together get one array."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from tests.cuda_cases import SIM

# A kernel defined here must see numba.cuda as a module global: the simulator swaps the module
# for its fake one in a kernel's globals, not in its closure (conftest.py has set the mode).
from numba import cuda, int32  # noqa: E402

pytestmark = pytest.mark.skipif(not SIM, reason="a simulator fix: on a GPU shared memory is the hardware's")


def test_shared_array_is_one_per_site_when_threads_race(monkeypatch):
    import qcore_cuda.intrin  # noqa: F401  (installs the fix, as every kernel module does)
    from numba.cuda.simulator import kernelapi

    shared = kernelapi.FakeCUDAShared(0)
    real_empty = np.empty

    def slow_empty(*a, **k):  # the allocation takes a while: the other thread arrives meanwhile
        time.sleep(0.05)
        return real_empty(*a, **k)

    monkeypatch.setattr(np, "empty", slow_empty)
    got = []

    def site():
        got.append(shared.array(8, np.int32))  # one call site for both threads

    threads = [threading.Thread(target=site) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 2 and got[0] is got[1], "two threads of a block got different shared arrays"
    a = shared.array(4, np.int32)
    b = shared.array(4, np.float32)  # another site: another array
    assert a is not b


def test_block_reduction_through_shared_memory_under_thread_switches():
    import sys

    import qcore_cuda.intrin  # noqa: F401

    @cuda.jit
    def k(out):
        cuda.syncthreads()  # every thread reaches the allocation together
        sh = cuda.shared.array(128, int32)
        t = cuda.threadIdx.x
        sh[t] = t
        cuda.syncthreads()
        if t == 0:
            s = 0
            for i in range(128):
                s += sh[i]
            out[0] = s

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for _ in range(10):
            out = np.zeros(1, np.int64)
            k[1, 128](out)
            assert out[0] == 127 * 128 // 2
    finally:
        sys.setswitchinterval(old)
