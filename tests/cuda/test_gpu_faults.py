"""GPU faults: device out-of-memory is one `DeviceMemoryError` naming the size asked for, and the
cuda backend stays usable after it.

The first test injects numba's out-of-memory error (CudaAPIError code 2) at the allocation and
runs everywhere (simulator in CI). The second fills a real GPU until a dequantize cannot fit, so
it runs only on a real GPU (`NUMBA_ENABLE_CUDASIM=0`).
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

import qcore
from qcore import DeviceMemoryError, QCoreError
from qcore.backend.reference import ReferenceBackend

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")
REF = ReferenceBackend()


class FakeOutOfMemory(Exception):
    """What numba raises when cuMemAlloc fails (CudaAPIError with code 2)."""

    code = 2

    def __str__(self) -> str:
        return "[2] Call to cuMemAlloc results in CUDA_ERROR_OUT_OF_MEMORY"


def test_out_of_memory_is_named_and_the_backend_recovers(cuda_backend, monkeypatch):
    from numba import cuda

    x = np.random.default_rng(0).standard_normal((4, 32)).astype(np.float32)
    q = cuda_backend.quantize(x, "q4s/block16:f16")
    real = cuda.device_array
    state = {"fail": True}

    def alloc(*a, **k):
        if state["fail"]:
            raise FakeOutOfMemory()
        return real(*a, **k)

    monkeypatch.setattr(cuda, "device_array", alloc)
    with pytest.raises(DeviceMemoryError, match=r"out of device memory to dequantize a \(4, 32\) q4s/block16:f16 "
                                                r"tensor to float32: it needs about 512 B \(512 bytes\)") as e:
        q.numpy()
    assert isinstance(e.value, QCoreError) and isinstance(e.value, MemoryError)
    assert "stays usable" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(DeviceMemoryError, match=r"quantize a \(4, 32\) tensor to q8s: it needs about"):
        cuda_backend.quantize(x, "q8s")
    state["fail"] = False  # memory is back: the same tensor and new work both succeed
    assert np.array_equal(q.numpy(), REF.from_data(q.to_data()).numpy())
    assert np.array_equal(cuda_backend.quantize(x, "q8s").numpy(), REF.quantize(x, "q8s").numpy())


def test_out_of_memory_while_loading_a_payload_is_named(cuda_backend, monkeypatch):
    from numba import cuda

    data = REF.quantize(np.ones((4, 32), np.float32), "q4s/block16:f16").to_data()

    def to_device(*a, **k):
        raise FakeOutOfMemory()

    monkeypatch.setattr(cuda, "to_device", to_device)
    with pytest.raises(DeviceMemoryError, match=r"out of device memory to load a \(4, 32\) q4s/block16:f16 payload"):
        cuda_backend.from_data(data)


def test_other_errors_pass_through(cuda_backend, monkeypatch):
    from numba import cuda

    def boom(*a, **k):
        raise RuntimeError("not a memory problem")

    monkeypatch.setattr(cuda, "device_array", boom)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        cuda_backend.quantize(np.ones((2, 16), np.float32), "q8s")


def _hold_all_but(nbytes: int) -> Any:
    """A device array of all the free device memory but `nbytes`. Other test processes share the
    GPU (pytest-xdist) and may take memory between the query and the allocation: measure again
    and retry."""
    from numba import cuda
    from numba.cuda.cudadrv.driver import CudaAPIError

    for _ in range(50):
        free = cuda.current_context().get_memory_info()[0]
        try:
            return cuda.device_array(free - nbytes, dtype=np.uint8)
        except CudaAPIError:
            time.sleep(0.1)
    pytest.fail(f"other processes kept changing the free device memory: could not hold all of it but {nbytes} bytes")


@pytest.mark.skipif(SIM, reason="needs a real GPU: fills its memory (NUMBA_ENABLE_CUDASIM=0 on the H200)")
def test_real_device_out_of_memory(cuda_backend):
    """Hold all but ~256 MiB of the device, then dequantize a tensor whose output needs 1 GiB:
    DeviceMemoryError naming 1 GiB; release the hold and the same call succeeds."""
    from numba import cuda

    n = 1 << 28  # 2**28 elements: 128 MiB of q4s payload, 1 GiB of float32 output
    x = np.tile(np.linspace(-1, 1, 256, dtype=np.float32), n // 256).reshape(-1, 4096)
    q = cuda_backend.quantize(x, "q4s/block32:f16")
    del x
    hold = _hold_all_but(256 << 20)
    try:
        with pytest.raises(DeviceMemoryError, match=r"dequantize a \(65536, 4096\) q4s/block32:f16 tensor to "
                                                    r"float32: it needs about 1\.0 GiB \(1073741824 bytes\)"):
            q.dequantize()
    finally:
        del hold
        cuda.current_context().deallocations.clear()
    y = cuda_backend.to_numpy(q.dequantize())
    assert y.shape == (65536, 4096) and np.isfinite(y).all()
