"""The packed launches of the `cuda` backend (qcore_cuda/_launch.py): repeatable, holding no
outputs, thread-safe, and refusing arguments that do not fit."""
from __future__ import annotations

import sys
import time

import numpy as np
import pytest

from qcore.errors import InputError
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM, sample_x, assert_same_bytes

REF = ReferenceBackend()
# numba after conftest.py has chosen the simulator or the GPU.
from numba import cuda  # noqa: E402


def test_launches_hold_no_outputs(cuda_backend):
    """A tensor's cached launches (dequantize, GEMV) keep no reference to the arrays a call
    passed or returned (x, the output): once the caller drops them they are gone (a 1 GiB
    dequantize, say, is freed)."""
    import gc
    import weakref

    qw = cuda_backend.quantize(sample_x((64, 64), seed=9), "q4s/block32:f16")
    for _ in range(2):  # the first call packs, the second swaps
        x = cuda.to_device(sample_x((1, 64), seed=10, scale=1.0))
        y, z = cuda_backend.dequantize(qw), cuda_backend.matmul(x, qw)
        refs = [weakref.ref(a) for a in (x, y, z)]
        del x, y, z
        gc.collect()
        assert [r() for r in refs] == [None] * 3, "a cached launch kept a call's array alive"


def _packed_counts():
    from qcore_cuda import _launch

    return dict(_launch.COUNTS)


def _through_dispatcher(before: dict) -> int:
    """Launches of packed kernels that went through numba's dispatcher since `before`."""
    return _packed_counts()["dispatcher"] - before["dispatcher"]


@pytest.mark.skipif(SIM, reason="packed launches bypass numba's dispatcher only on a GPU; the simulator always "
                             "takes the dispatcher (qcore_cuda/_launch.py)")
@pytest.mark.parametrize("m", [1, 5])
def test_packed_launches_repeat_results(cuda_backend, m):
    """After the first call (through numba's dispatcher), the GEMV and dequantize launches reuse
    their packed argument lists with new x / output pointers: results equal the first call's
    bit for bit, and a different x gives its own product."""

    text = "q4s/block32:f16"
    w = sample_x((256, 512), seed=5)
    qw = cuda_backend.quantize(w, text)
    x1, x2 = sample_x((m, 256), seed=6, scale=1.0), sample_x((m, 256), seed=7, scale=1.0)
    first = cuda_backend.to_numpy(cuda_backend.matmul(cuda.to_device(x1), qw))
    before = _packed_counts()
    second = cuda_backend.to_numpy(cuda_backend.matmul(cuda.to_device(x2), qw))
    again = cuda_backend.to_numpy(cuda_backend.matmul(cuda.to_device(x1), qw))
    assert _through_dispatcher(before) == 0, "the GEMV launch was not packed"
    np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))
    wd = REF.dequantize(REF.from_data(cuda_backend.into_data(qw))).astype(np.float64)
    for x, got in ((x1, first), (x2, second)):
        want = x.astype(np.float64) @ wd
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    d1 = cuda_backend.to_numpy(cuda_backend.dequantize(qw))
    before = _packed_counts()
    d2 = cuda_backend.dequantize(qw)
    d3 = cuda_backend.dequantize(qw)
    assert _through_dispatcher(before) == 0, "the dequantize launch was not packed"
    assert d2.__cuda_array_interface__["data"][0] != d3.__cuda_array_interface__["data"][0]
    for d in (d2, d3):
        np.testing.assert_array_equal(cuda_backend.to_numpy(d).view(np.uint32), d1.view(np.uint32))
    np.testing.assert_array_equal(d1.view(np.uint32), wd.astype(np.float32).view(np.uint32))


@pytest.mark.skipif(SIM, reason="packed launches bypass numba's dispatcher only on a GPU; the simulator always "
                             "takes the dispatcher (qcore_cuda/_launch.py)")
@pytest.mark.parametrize("text", ["q8s/block32:f16", "nvfp4", "q8s", "q4s/block8:f16"])
def test_packed_quantize_launches(cuda_backend, text):
    """The fast quantize launches, packed after their first call, write each new x's payload
    (calibrated and explicit scales); after a non-finite input (a new scratch) they are packed
    again and still flag and quantize correctly."""

    be = type(cuda_backend)()  # its own scratch and plans
    xs = [sample_x((4, 256), seed=s) for s in (1, 2, 3)]
    for i, x in enumerate(xs + xs[:1]):
        before = _packed_counts()
        for params in (None, REF.calibrate(x, text)):
            got = be.into_data(be.quantize(cuda.to_device(x), text, params=params))
            want = REF.into_data(REF.quantize(x, text, params=params))
            assert_same_bytes(got.payload, want.payload, f"{text} (params={params is not None})")
        if i:  # after the first calls every fast launch reuses its packed arguments
            assert _through_dispatcher(before) == 0, f"{text}: a fast quantize launch was not packed"
    bad = xs[0].copy()
    bad[1, 7] = np.nan
    with pytest.raises(InputError):
        be.quantize(cuda.to_device(bad), text)
    for x in xs:
        got = be.into_data(be.quantize(cuda.to_device(x), text))
        assert_same_bytes(got.payload, REF.into_data(REF.quantize(x, text)).payload, f"{text} after a non-finite input")
    with pytest.raises(InputError):
        be.quantize(cuda.to_device(bad), text)


def test_packed_launch_is_thread_safe():
    """Threads sharing one cached launch (a tensor used by a thread pool) each launch with their
    own values: the swap of the changing arguments and the launch happen under one lock."""
    import threading

    from qcore_cuda._launch import Packed

    seen = []

    class FakeDispatcher:  # records (caller, value) at launch time; yields the GIL before it
        def __getitem__(self, config):
            time.sleep(0)

            def launch(*args):
                seen.append((threading.get_ident(), args[0]))
            return launch

    p = Packed(FakeDispatcher(), 1, 1, [None, "static"], dynamic=(0,))
    p._state = False  # the dispatcher path (the packed path shares the same lock)

    def work(tag):
        for k in range(300):
            p((tag, k))

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    owner = {}
    for ident, (tag, k) in seen:
        assert owner.setdefault(tag, ident) == ident, "a launch ran with another thread's arguments"
    assert len(seen) == 1200 and p._args == [None, "static"]


def test_packed_swap_rejects_what_does_not_fit():
    """A packed launch swaps a device pointer only for a contiguous 1-D array of the packed dtype
    and length, and an integer only for an integer; anything else sends the call to numba's
    dispatcher (the swap reports False and changes nothing)."""
    import ctypes

    from qcore_cuda._launch import Packed

    class Dev:  # a device array as far as the swap looks: __cuda_array_interface__, dtype, shape
        def __init__(self, ptr, n, dtype=np.float32, strides=None):
            self.dtype, self.shape = np.dtype(dtype), (n,)
            self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (n,), "strides": strides,
                                             "typestr": self.dtype.str, "version": 3}

    p = Packed(None, 1, 1, [None, None], dynamic=(0, 1))
    kargs = [0, 0, 8, 4, 1000, 8, 4, ctypes.c_int64(3)]
    p._state = (None, None, None, None, kargs)
    p._swaps = [(0, "array", 4, (np.dtype(np.float32), (8,))), (1, "int", 7, ctypes.c_int64)]
    for bad in ([Dev(2000, 9), 5], [Dev(2000, 8, np.int32), 5], [Dev(2000, 8, strides=(8,)), 5],
                [object(), 5], [Dev(2000, 8), 2.5]):
        assert p._swap(bad) is False
        assert kargs[4] == 1000 and kargs[7].value == 3
    assert p._swap([Dev(2000, 8, strides=(4,)), 5]) is True
    assert kargs[4] == 2000 and kargs[7].value == 5
    assert p._swap([Dev(3000, 8)]) is True  # the first k dynamic values; the others keep theirs
    assert kargs[4] == 3000 and kargs[7].value == 5


def test_cluster_launch_config():
    """A packed launch in thread-block clusters holds one `CUlaunchConfig`: the grid and block in
    blocks, the cluster shape as its one attribute, no dynamic shared memory (cuda-bindings; no
    GPU needed)."""
    from cuda.bindings import driver as cu

    from qcore_cuda._launch import _cluster_config

    cfg = _cluster_config(cu, (64, 4, 1, 512, 1, 1), (1, 4))
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (64, 4, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (512, 1, 1)
    assert cfg.sharedMemBytes == 0 and cfg.numAttrs == 1
    attr = cfg.attrs[0]
    assert attr.id == cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    assert (attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z) == (1, 4, 1)


_INTERNALS = """
import json
from numba.cuda import dispatcher
from qcore_cuda._launch import numba_internals_problems
now = numba_internals_problems()
dispatcher._Kernel._prepare_args = lambda self, ty, val, kernelargs: None  # what an upgrade might do
print(json.dumps([now, numba_internals_problems()]))
"""


def test_numba_internals_packed_relies_on(cuda_backend):
    """`Packed` uses numba-cuda's private argument packing; this fails loudly when an upgrade
    changes it (the backend would only fall back to the slower dispatcher launch). Runs the real
    numba.cuda in a subprocess: the simulator has none of it. No GPU needed."""
    import json
    import os
    import subprocess

    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="0")
    out = subprocess.run([sys.executable, "-c", _INTERNALS], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    now, patched = json.loads(out.stdout.strip().splitlines()[-1])
    assert now == [], f"numba-cuda internals used by qcore_cuda._launch changed: {now}"
    assert any("_prepare_args takes" in p for p in patched), patched  # the check does see a change
