"""Which of the cuda backend's paths (qcore_cuda.paths) serves a call: each path's `applies()`
against the layouts it is for, and the results equal to the reference's bytes whichever path ran."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import sample_x

REF = ReferenceBackend()
NVFP4 = "e2m1/block16:ue4m3/tensor:f32/packed_native"

# (scheme, shape, given scales, fast kernels on) -> (quantize path, dequantize path)
CASES = [
    ("q8s/block32:f16", (4, 64), False, True, "FastQuantize", "FastDequantize"),
    ("q8s", (4, 64), False, True, "FastQuantize", "FastDequantize"),  # two passes: max |x| first
    (NVFP4, (4, 64), False, True, "FastQuantize", "FastDequantize"),
    ("q8s/block32:f16", (4, 64), True, True, "StagedQuantize", "FastDequantize"),  # fast codes, given scales
    ("q8s/block8:f16", (4, 64), False, True, "TileQuantize", "FastDequantize"),  # blocks below 16: no fast calibration
    ("q4s/block32:f16/packed_native:0", (64, 8), False, True, "TileQuantize", "RowsDequantize"),  # packed along rows
    ("q8s/block4x1:f16", (8, 16), False, True, "FusedQuantize", "GeneralDequantize"),  # blocks down the columns
    ("q4f/block8x4:bf16/packed_u32:1", (8, 64), False, True, "StagedQuantize", "GeneralDequantize"),  # 2-D blocks
    ("q8s/block32:f16", (4, 64), False, False, "TileQuantize", "RowsDequantize"),  # QCORE_CUDA_FAST=0
    ("q8s", (4, 64), False, False, "StagedQuantize", "RowsDequantize"),  # one per-tensor scale
    (NVFP4, (4, 64), False, False, "StagedQuantize", "RowsDequantize"),  # two-level
    ("e4m3/block1024:f32", (3, 1024), False, True, "WideQuantize", "RowsDequantize"),  # a slot per row: one kernel
    ("q4s/block128:f16", (3, 1024), False, False, "StagedQuantize", "RowsDequantize"),  # wide 4-bit: staged
]


def _backend(fast: bool, monkeypatch):
    from qcore_cuda import CudaBackend

    if not fast:
        monkeypatch.setenv("QCORE_CUDA_FAST", "0")
    be = CudaBackend()  # a fresh instance reads QCORE_CUDA_FAST
    if not be.available():
        pytest.skip("no CUDA device and no simulator")
    return be


@pytest.mark.parametrize("text,shape,given,fast,q_path,dq_path", CASES)
def test_the_path_that_applies_serves_the_call(monkeypatch, text, shape, given, fast, q_path, dq_path):
    from qcore_cuda.paths import TAKEN

    be = _backend(fast, monkeypatch)
    x = sample_x(shape, seed=3)
    params = REF.calibrate(x, text) if given else None
    before = TAKEN.copy()
    q = be.quantize(x, text, params=params)
    y = be.to_numpy(be.dequantize(q))
    taken = dict(TAKEN - before)
    assert taken == {q_path: 1, dq_path: 1}, taken
    want = REF.quantize(x, text, params=params)
    assert be.into_data(q).payload == REF.into_data(want).payload
    np.testing.assert_array_equal(y.view(np.uint32), REF.dequantize(want).view(np.uint32))


@pytest.mark.parametrize("text,path", [("q4s/block32:f16", "GemvMatmul"),
                                       ("q4f/block8x4:bf16/packed_u32:1", "GeneralMatmul")])
def test_matmul_paths(monkeypatch, text, path):
    from qcore_cuda.paths import TAKEN

    be = _backend(True, monkeypatch)
    w = sample_x((64, 64), seed=4)
    x = sample_x((1, 64), seed=5, scale=1.0)
    qw = be.from_data(REF.into_data(REF.quantize(w, text)))
    before = TAKEN.copy()
    got = be.to_numpy(be.matmul(x, qw))
    assert dict(TAKEN - before) == {path: 1}
    want = x.astype(np.float64) @ REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_every_list_ends_in_a_path_that_always_applies():
    from qcore_cuda.paths import choose
    from qcore_cuda.paths.dequantize import DEQUANTIZE
    from qcore_cuda.paths.matmul import MATMUL
    from qcore_cuda.paths.quantize import QUANTIZE

    for paths in (QUANTIZE, DEQUANTIZE, MATMUL):
        assert paths[-1].applies(None) is True
        names = [p.name for p in paths]
        assert len(set(names)) == len(names), names
    assert choose(QUANTIZE[-1:], None) is QUANTIZE[-1]
    assert qcore.scheme(NVFP4).two_level


# Blocks wider than a warp along rows: the block maxima come from one thread block per slot
# (k_wide_stats); the bytes are the reference's, edge blocks and two-level schemes included.
WIDE = [
    ("e4m3/block256:f32", (5, 300)),  # an edge block of 44 in every row
    ("e4m3/block1024:f32", (3, 1024)),  # one slot per row, as W8A8 quantizes x
    ("q8s/block100:f16", (4, 250)),  # not a power of two
    ("q8f/block128:bf16", (4, 384)),
    ("e5m2/block512:f32", (3, 600)),
    ("q4s/block64:bf16", (6, 128)),
    ("e2m1/block64:ue4m3/tensor:f32/packed_native", (4, 192)),  # two-level: the max over slots too
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "no-fast"])
@pytest.mark.parametrize("text,shape", WIDE)
def test_wide_row_blocks_equal_the_reference(monkeypatch, text, shape, fast):
    be = _backend(fast, monkeypatch)
    x = sample_x(shape, seed=7)
    x[1] = 0.0  # an all-zero row
    # exact ties under a scale of 1: e4m3 (max 448; 1.0625 lies halfway between 1 and 1.125) and
    # int8 (max 127; 2.5 and -3.5): round half to even, decided by the last bit of y = x / e
    x[0, :4] = [448.0, 1.0625, -1.1875, 0.0]
    x[2, :4] = [127.0, 2.5, -3.5, 0.5]
    x[0, 5] = -0.0  # a minifloat's code of -0 is its own (a division by a reciprocal gives +0)
    x[-1, -3] = -50.0  # the edge block's maximum, negative, near its end
    q = be.quantize(x, text)
    want = REF.quantize(x, text)
    assert be.into_data(q).payload == REF.into_data(want).payload
    bad = x.copy()
    bad[-1, 7] = np.nan
    with pytest.raises(qcore.InputError):
        be.quantize(bad, text)


# bfloat16 x read two elements to a word (W8A8's read of a torch bfloat16 x): slots that start on
# a word and slots that do not, an odd count with one last element, the rows read four words a
# thread at a time, 16-byte quads held in registers (`fast.WIDE_HELD` a thread) or read twice;
# the bytes those of quantizing x.astype(float32).
BF16_WIDE = [
    ("e4m3/block1024:f32", (3, 1024)),  # one slot per row, as W8A8 quantizes x
    ("e4m3/block256:f32", (5, 300)),  # an edge slot of 44, starting on a word
    ("q8s/block33:f32", (3, 130)),  # odd slots: a last element alone, then slots starting mid-word
    ("e5m2/block512:f32", (3, 602)),
    ("e4m3/block2048:f32", (2, 2100)),  # 8 quads a thread under the simulator's 32 threads: held
    ("e4m3/block4096:f32", (2, 4200)),  # a slot longer than a thread block holds: read twice
    ("q8s/block264:f32", (2, 528)),  # 33 quads a slot: one thread holds a second quad
    ("q8s/block256:f32", (3, 512)),  # int8 codes, 16 bytes of x at a time
]


@pytest.mark.parametrize("fast", [True, False], ids=["fast", "no-fast"])
@pytest.mark.parametrize("text,shape", BF16_WIDE)
def test_wide_rows_read_bfloat16_bits_as_their_float32_values(monkeypatch, text, shape, fast):
    """The bytes of quantizing x.astype(float32), read from x's bfloat16 bits (the cases above),
    with the fast kernels (the 16-byte kernel of the scheme's value kind) and without them; a NaN
    named by the check."""
    import ml_dtypes
    from numba import cuda

    from qcore.spec.schemes import scheme as parse_scheme
    from qcore_cuda import _streams
    from qcore_cuda.paths.quantize import quantize_bf16_rows

    be = _backend(bool(fast), monkeypatch)
    x = sample_x(shape, seed=11).astype(ml_dtypes.bfloat16)
    x[0, :4] = [448.0, 1.0625, -1.1875, 0.0]  # ties of e4m3 under a scale of 1
    x[0, 5] = -0.0
    x[-1, -1] = -50.0  # the last element of the last row: a slot's maximum read alone
    s = _streams.resolve(None, None)
    q, check = quantize_bf16_rows(be, cuda.to_device(x.view(np.uint16)), parse_scheme(text), s)
    check()
    assert be.into_data(q).payload == REF.into_data(REF.quantize(x.astype(np.float32), text)).payload
    x[1, 7] = np.nan
    q, check = quantize_bf16_rows(be, cuda.to_device(x.view(np.uint16)), parse_scheme(text), s)
    with pytest.raises(qcore.InputError, match=r"\(1, 7\)"):
        check()


@pytest.mark.parametrize("offset", [2, 4, 8], ids=lambda o: f"offset{o}")
def test_wide_rows_of_bfloat16_off_a_16_byte_boundary(monkeypatch, offset):
    """x starting 4, 8 or 16 bytes into its allocation: off a 16-byte boundary the GPU takes the
    kernel that reads a word at a time, on one the 16-byte kernel; the same bytes either way."""
    import ml_dtypes
    from numba import cuda

    from qcore.spec.schemes import scheme as parse_scheme
    from qcore_cuda import _streams
    from qcore_cuda.paths.quantize import quantize_bf16_rows

    be = _backend(True, monkeypatch)
    text, shape = "e4m3/block1024:f32", (4, 1024)
    x = sample_x(shape, seed=13).astype(ml_dtypes.bfloat16)
    x[2, 100] = -300.0
    flat = np.zeros(x.size + offset, np.uint16)
    flat[offset:] = x.view(np.uint16).ravel()
    d = cuda.to_device(flat)[offset:].reshape(shape)
    q, check = quantize_bf16_rows(be, d, parse_scheme(text), _streams.resolve(None, None))
    check()
    assert be.into_data(q).payload == REF.into_data(REF.quantize(x.astype(np.float32), text)).payload
