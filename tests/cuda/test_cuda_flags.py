"""The flags kernels set on bad input (qcore_cuda/_flags.py): words of mapped host memory on a
GPU, which a kernel's store reaches without a copy; device arrays under the simulator. What
the calls raise through them is tested where the calls are (test_cuda_repeat.py,
test_invalid_codes.py); here, the words themselves."""
from __future__ import annotations

import gc

import numpy as np
import pytest

from tests.cuda_cases import SIM

pytest.importorskip("numba")
pytest.importorskip("qcore_cuda")

from numba import cuda  # noqa: E402
from qcore_cuda import _flags, grids  # noqa: E402,F401 - grids: numba-cuda's np.row_stack alias (numpy >= 2.5)


@pytest.fixture
def gpu(cuda_backend):
    if SIM:
        pytest.skip("mapped host memory needs a GPU (the simulator's flags are its device arrays)")
    return cuda_backend


def test_simulator_flags_are_device_arrays(cuda_backend):
    """Under the simulator a flag is a zeroed 1-element int32 device array."""
    if not SIM:
        pytest.skip("the simulator's case; on a GPU the flags are mapped words (the tests below)")
    f = _flags.new()
    assert not _flags.is_host_flag(f)
    assert f.copy_to_host().tolist() == [0] and f.dtype == np.int32


def test_a_kernels_store_reaches_the_host_word(gpu):
    """A kernel writing flag[0] = 1 is seen in `.value` after a wait for its stream; `clear()`
    sets it back; the word is zero when handed out."""

    @cuda.jit
    def k_set(flag, v):
        flag[0] = v

    f = _flags.new()
    assert _flags.is_host_flag(f) and f.value == 0
    k_set[1, 1](f, 1)
    cuda.synchronize()
    assert f.value == 1 and f.copy_to_host().tolist() == [1]
    f.clear()
    assert f.value == 0
    k_set[1, 1](f, 7)
    cuda.synchronize()
    assert f.value == 7


def test_words_are_reused_and_distinct(gpu):
    """Live flags hold distinct words; a collected flag's word goes back and is handed out again
    (zeroed), so a process making tensors in a loop keeps a bounded number of pages."""
    flags = [_flags.new() for _ in range(_flags.PAGE_WORDS + 3)]  # more than a page
    addrs = {f.__cuda_array_interface__["data"][0] for f in flags}
    assert len(addrs) == len(flags)
    pages = len(_flags._pages)
    gone = flags.pop().__cuda_array_interface__["data"][0]
    gc.collect()
    again = [_flags.new() for _ in range(4)]
    assert gone in {f.__cuda_array_interface__["data"][0] for f in again}
    assert all(f.value == 0 for f in again)
    del flags, again
    gc.collect()
    for _ in range(3 * _flags.PAGE_WORDS):
        _flags.new()
    assert len(_flags._pages) == pages, "collected flags' words were not reused"
