"""`linear` of the `cuda` backend at one or two rows of bfloat16 / float16 x on the tensor-core
decode kernel (`qcore_cuda/k_decode_mma.py`, the path `MmaDecodeLinear`): every value kind it
decodes, per-tensor and per-row scales, blocks of 32 to at least K (4-bit codes) and of 16 (8-bit),
stored 16-bit and f32 scales, a two-level weight, odd N (a partial 16-row tile), K from one lane
chunk to several staged segments with a partial super chunk, with and without a bias, each result
dtype.

Every result lies within docs/spec.md's products' bound and repeats bit for bit. Where the
kernel's order fixes the bits they are checked too: a row of x gives the same f32 sums alone and
beside a second row (B's columns are independent sums), and a float16 / bfloat16 result is the
float32 result rounded once."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM
from tests.cuda_cases import bits as _bits, host as _host, taken as _taken, within_bound as _within_bound

REF = ReferenceBackend()
BF16 = np.dtype(ml_dtypes.bfloat16)
XDT = {"bf16": BF16, "f16": np.dtype(np.float16)}
# every value kind the kernel decodes (I4, E2M1, I8, E4M3, E5M2); stored f16 / bf16 slots (q4s,
# q4_0's signed ones, q8s), UE8M0 (mxfp4, mxfp8), per-row (q8s) and per-tensor (e5m2) scales, blocks
# of 32, 64 and 4096 (at least K: one slot a row), 8-bit codes under blocks of 16 (a lane chunk is
# 16 codes), a two-level weight (UE4M3 blocks of 32 under an f32 global: its effective f32 scales)
SCHEMES = ["q4s/block32:f16", "q4f/block64:bf16", "q4_0", "q4s/block4096:f16", "mxfp4",
           "e2m1/block32:ue4m3/tensor:f32", "q8s/block32:f16", "q8s", "q8s/block16:bf16", "mxfp8",
           "e4m3/block32:f32", "e5m2"]


def _weight(n, k, seed=0):
    return np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)


def _x(m, k, dt, seed=1):
    return np.random.default_rng(seed).standard_normal((m, k)).astype(dt)


@pytest.fixture(autouse=True)
def mma_on(monkeypatch):
    """The tensor-core decode path at both M it takes, whatever the default."""
    from qcore_cuda import k_decode_mma
    from qcore_cuda.paths import linear as paths_linear

    monkeypatch.setattr(paths_linear, "MMA_DECODE_MAX_M", k_decode_mma.MBS[-1])


_CASES = [(t, xt, 1 + (i + j) % 2, (i + j) % 2 == 0) for i, t in enumerate(SCHEMES) for j, xt in enumerate(XDT)] \
    if SIM else [(t, xt, m, b) for t in SCHEMES for xt in XDT for m in (1, 2) for b in (False, True)]


@pytest.mark.parametrize("text,xt,m,bias", _CASES)
def test_mma_decode_linear(cuda_backend, text, xt, m, bias):
    """Within the bound (odd N, K with a partial super chunk), the path taken, x's dtype out, the
    same bits again on a repeat call."""
    be = cuda_backend
    n, k = (7, 160) if SIM else (203, 1056)
    w = _weight(n, k)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = _x(m, k, XDT[xt])
    b = _x(1, n, np.float32, 2)[0] if bias else None
    before = _taken("MmaDecodeLinear")
    y = _host(be, be.linear(x, q, b))
    assert _taken("MmaDecodeLinear") == before + 1
    assert y.dtype == XDT[xt] and y.shape == (m, n)
    _within_bound(x, W, b, y)
    assert np.array_equal(_bits(_host(be, be.linear(x, q, b))), _bits(y))


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s/block64:f16", "e2m1/block32:ue8m0"])
@pytest.mark.parametrize("k", [32, 96, 2112] + ([] if SIM else [8192, 8224, 28672]))
def test_k_from_one_chunk_to_several_segments_and_rows_alone_or_together(cuda_backend, text, k):
    """K of one lane chunk (32), a partial super chunk (96), several staged segments a warp (2112
    on the simulator: two warps of ten super chunks in segments of four), on a GPU the shapes of a
    model's layers too. Row 1 of x gives the same f32 bits alone as beside row 0 (its own
    columns of B), and a float16 / bfloat16 result is that f32 result rounded once."""
    be = cuda_backend
    n = 21
    w = _weight(n, k, 3)
    q = be.quantize(w, text)
    W = np.asarray(REF.dequantize(REF.quantize(w, text)), np.float64)
    x = _x(2, k, BF16, 4)
    b = _x(1, n, np.float32, 5)[0]
    before = _taken("MmaDecodeLinear")
    y2 = _host(be, be.linear(x, q, b, dtype=np.float32))
    _within_bound(x, W, b, y2)
    for i in (0, 1):
        y1 = _host(be, be.linear(x[i:i + 1], q, b, dtype=np.float32))
        assert np.array_equal(_bits(y1[0]), _bits(y2[i])), (text, k, i)
    yb = _host(be, be.linear(x, q, b))
    assert yb.dtype == BF16 and np.array_equal(_bits(yb), _bits(y2.astype(BF16)))
    yh = _host(be, be.linear(x[:1], q, b, dtype=np.float16))
    assert np.array_equal(_bits(yh), _bits(y2[:1].astype(np.float16)))
    assert _taken("MmaDecodeLinear") == before + 5


def test_zero_codes_sum_to_zero_and_x_is_read_exactly(cuda_backend):
    """A row of zero codes under a nonzero scale gives exactly the bias, a zero block among nonzero
    ones adds nothing, and x of one nonzero column picks that column's weight times x exactly (the
    products are exact, and the other lane chunks' columns of B are zeros)."""
    be = cuda_backend
    n, k = 4, 256
    w = _weight(n, k, 7)
    w[1] = 0.0
    w[2, :32] = 0.0
    q = be.quantize(w, "q4s/block32:f16")
    W = np.asarray(REF.dequantize(REF.quantize(w, "q4s/block32:f16")), np.float32)
    b = np.array([0.5, -1.25, 2.0, 0.0], np.float32)
    for dt in XDT.values():
        for col in (5, 37, 200):
            x = np.zeros((1, k), dt)
            x[0, col] = 3
            y = _host(be, be.linear(x, q, b, dtype=np.float32))
            assert y[0, 1] == b[1]
            assert np.array_equal(y[0], (W[:, col] * np.float32(3) + b).astype(np.float32)), (dt, col)


def test_which_calls_take_the_path(cuda_backend, monkeypatch):
    """Up to two rows of bfloat16 / float16 x on a weight whose lane chunks each lie under one slot;
    not float32 x, not 4-bit codes under blocks of 16 (two slots a chunk: the CUDA-core decode
    kernel), not three rows, nothing with MMA_DECODE_MAX_M = 0."""
    from qcore_cuda.paths import linear as paths_linear

    be = cuda_backend
    k = 64
    q = be.quantize(_weight(6, k), "q4s/block32:f16")
    for x, path in ((_x(2, k, BF16), "MmaDecodeLinear"), (_x(1, k, np.float32), "DecodeLinear"),
                    (_x(3, k, np.float16), "TensorCoreLinear")):
        before = _taken(path)
        be.linear(x, q)
        assert _taken(path) == before + 1, (x.shape, x.dtype, path)
    for text in ("nvfp4", "q4s/block16:f16"):
        before = _taken("DecodeLinear")
        be.linear(_x(1, k, BF16), be.quantize(_weight(6, k), text))
        assert _taken("DecodeLinear") == before + 1, text
    monkeypatch.setattr(paths_linear, "MMA_DECODE_MAX_M", 0)
    before = _taken("DecodeLinear")
    be.linear(_x(1, k, BF16), q)
    assert _taken("DecodeLinear") == before + 1


def test_the_plan_rounds_a_warps_range_to_whole_batches():
    """Each warp's range of super chunks is a multiple of U (its batches never reach the next
    warp's range) and the ranges cover K; a lane chunk past K reads the row's last chunk against
    zeros of x (module text)."""
    from qcore_cuda import fast, k_decode_mma, linear
    from qcore.spec.schemes import scheme as parse_scheme

    for k in (32, 96, 160, 2112, 8192, 28672):
        kind, P = linear.geometry((16, k), parse_scheme("q4s/block32:f16"))
        q, grid, block = k_decode_mma.plan(kind, P, 1, linear.OT_F32, False)
        spw = q[k_decode_mma.DM_SPW]
        assert spw % k_decode_mma.U == 0 and spw * k_decode_mma.WARPS * 128 >= k, (k, spw)
        assert grid == (1,) and block == (32 * k_decode_mma.WARPS,)
    assert k_decode_mma.chunk_codes(fast.KIND_I4) == 32 and k_decode_mma.chunk_codes(fast.KIND_I8) == 16
