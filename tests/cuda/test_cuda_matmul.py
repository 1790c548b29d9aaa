"""`matmul` of the `cuda` backend: the fused kernel, the GEMV and tensor-core paths, against
the reference within the conformance bound."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import SIM, assert_f32_sums, sample_x

REF = ReferenceBackend()
# A kernel defined here must see numba.cuda as a module global: the simulator swaps the module
# for its fake one in a kernel's globals, not in its closure (conftest.py has set the mode).
from numba import cuda  # noqa: E402


_FUSED_TEXTS = ["q8s", "q8s/block32:f16", "q4s/block32:f16", "q4f/block8x4:bf16/packed_u32:1", "e4m3/block32:f32",
                "e2m1/block16:ue4m3/tensor:f32/packed_native", "q2s/block16:ue8m0/packed_native:1", "e5m2/tensor:ue4m3"]
_FUSED_M, _FUSED_N = [1, 3, 16], [37, 40, 64]
# On the simulator a Latin square: every scheme with every M and every N, every (M, N) pair
# (24 cases); on a GPU all 72.
_FUSED_CASES = ([(t, m, _FUSED_N[(i + j) % 3]) for i, t in enumerate(_FUSED_TEXTS) for j, m in enumerate(_FUSED_M)]
                if SIM else [(t, m, n) for t in _FUSED_TEXTS for m in _FUSED_M for n in _FUSED_N])


@pytest.mark.parametrize("text,m,n_", _FUSED_CASES)
def test_fused_matmul(cuda_backend, text, m, n_):
    """x [M, K] @ w [K, N] with w dequantized inside the kernel equals x @ dequantize(w) (f32
    accumulation, so to rounding). K spans several k-chunks; N = 37 leaves a partial column group
    (per-code path for Native), N = 40 takes the word-per-thread path, N = 64 (512 on a GPU) the
    GEMV kernel for the last-axis layouts, whose results repeat bit for bit. On the simulator K
    stays below the tensor-core kernel's `MIN_K` (its own tests cover it; each of its mma steps
    costs the simulator two block barriers)."""
    k_ = 62 if SIM else 1000
    n_ = n_ if SIM else n_ * 8 + n_ % 8
    w = sample_x((k_, n_), seed=9)
    x = sample_x((m, k_), seed=10, scale=1.0)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    wf = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    want = x.astype(np.float64) @ wf
    assert got.shape == (m, n_) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    got3 = cuda_backend.to_numpy(cuda_backend.matmul(x.reshape(1, m, k_), qw))
    assert got3.shape == (1, m, n_)
    from qcore_cuda import gemv

    takes_gemv = gemv.geometry((k_, n_), qcore.scheme(text)) is not None
    if n_ in (64, 512):
        assert takes_gemv == (not any(t in text for t in ("x4", ":1")))
    if takes_gemv:
        np.testing.assert_array_equal(got3.reshape(m, n_).view(np.uint32), got.view(np.uint32))


_GEMV_CASES = [
    ("q4s/block32:f16", 64, 2, True),  # 8-byte loads, one scale per thread-row
    ("q4s/block8:bf16", 64, 2, False),  # a scale slot per word
    ("q4f/block16:f32", 48, 2, True),
    ("e2m1/block16:ue4m3/tensor:f32/packed_native", 48, 2, True),
    ("q8s/block4:f16", 48, 2, False),
    ("q2s/block16:f16", 80, 1, True),  # 5 words per row: 4-byte loads
    ("e4m3", 64, 2, True),
]
# M = 2 (two rows per launch, the same variants) on the simulator for two of them, on a GPU all
_GEMV_M2 = [c for c in _GEMV_CASES if not SIM or c[0] in ("q4s/block8:bf16", "q8s/block4:f16")]


@pytest.mark.parametrize("text,n_,wpt,one,m", [(*c, 1) for c in _GEMV_CASES] + [(*c, 2) for c in _GEMV_M2])
def test_gemv_paths(cuda_backend, text, n_, wpt, one, m):
    """Every GEMV kernel variant `config_for` picks at M = 1 (words per thread, scale slots per
    thread-row): on the simulator K leaves a thread of the first k-split 19 rows (2 steps of 8
    at M = 1 for 8-bit codes and 4-bit integers, else 4 steps of 4, so both register sets of
    the prefetch pipeline, and 3 single rows after them; 10 rows, 2 steps of 4 and 2 single, in
    the 16 x 16 blocks of 2-bit codes) under 2 k-splits; the results equal x @ dequantize(w)
    to rounding and repeat bit for bit."""
    from qcore_cuda import gemv

    k_ = 300 if SIM else 1000 * 8 + 23
    w = sample_x((k_, n_), seed=11)
    x = sample_x((m, k_), seed=12, scale=1.0)
    kind, Q = gemv.geometry((k_, n_), qcore.scheme(text))
    if m == 1:
        assert gemv.config_for(kind, m, Q)[1:] == (wpt, one)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    want = x.astype(np.float64) @ REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    again = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))


def _launch_gemv_kernel(backend, qw, kern, grid, block, part, cnt, q, x, m, n_, tc=False):
    """One launch of a GEMV kernel (gemv.py, or tc.py's with `tc`: the scales by slot last) on
    qw's device buffers, as the backend launches it; returns out [m, n_] on the host."""
    data = qw.data
    scales, gbuf = backend.decoded_scales(data)
    pp = backend.state.plans.get(data.shape, data.scheme, "minmax")
    w32 = backend.state.plans.code_words(data)
    out = cuda.device_array(m * n_, dtype=np.float32)
    extra = []
    if tc:
        from qcore_cuda import tc as tc_

        extra = [tc_.slot_scales(scales, gbuf, np.asarray(q, dtype=np.int64))]
    kern[grid, block](cuda.to_device(x.reshape(-1)), w32, scales, gbuf, pp.lut, part, cnt, out,
                      tuple(int(v) for v in q), 0, m, *extra)
    return out.copy_to_host().reshape(m, n_)


@pytest.mark.parametrize("wpt,rows,shape", [(4, 2, (32, 8)), (4, 4, (16, 16))])
def test_gemv_wide_word_variants(cuda_backend, wpt, rows, shape):
    """The FFMA kernel with 16-byte loads per thread-row (wpt = 4) at M = 1, a variant
    `benchmarks/gpu_tune.py` times beside the default: K leaves partial steps under 2 k-splits;
    the sums are x @ dequantize(w) within the matmul bound."""
    from qcore_cuda import gemv

    k_, n_ = (230, 64) if SIM else (8000 + 23, 2048)
    text = "q4s/block32:f16"
    x = sample_x((1, k_), seed=31, scale=1.0)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(sample_x((k_, n_), seed=32), text)))
    kind, Q = gemv.geometry(qw.data.shape, qw.data.scheme)
    q, grid, block = gemv.plan(Q, wpt, 2, rows, shape)
    part = cuda.device_array(int(q[gemv.Q_KS]) * n_, dtype=np.float32)
    cnt = cuda.to_device(np.zeros(grid[0], dtype=np.int32))
    kern = cuda.jit(gemv._gemv_kernel(kind, 1, wpt, True, rows, True, shape))
    got = _launch_gemv_kernel(cuda_backend, qw, kern, grid, block, part, cnt, q, x, 1, n_)
    W = REF.dequantize(REF.from_data(cuda_backend.into_data(qw))).astype(np.float64)
    assert grid[1] >= 2 and np.all(np.abs(got - x.astype(np.float64) @ W) <= _matmul_bound(x, W))
    assert not cnt.copy_to_host().any()


def _matmul_bound(x, W):
    """The conformance suite's matmul bound (matmul_rel = 2): 2 K 2**-24 (|x| @ |W|)."""
    return 2 * x.shape[-1] * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(W))


_TC_TEXTS = ["q4s/block32:f16", "q8f/block32:f32", "q2s/block32:f16", "e4m3/block64:bf16", "e5m2",
             "e2m1/block32:ue8m0", "e4m3/block32:ue4m3/tensor:f32", "q4f/block64:f16/packed_native"]
# The simulator runs each mma as two block barriers: there, four kinds (one-level integer and
# E2M1 codes, two-level E4M3, 8-bit float scales) and each M regime once (one group of 8 rows,
# two groups, 16 rows, two launches); on a GPU every kind with every M. The other kinds' code
# decoding is the GEMV kernels' (test_gemv_paths runs every kind on the simulator).
_TC_CASES = ([("q4s/block32:f16", 4), ("e2m1/block32:ue8m0", 9), ("e4m3/block32:ue4m3/tensor:f32", 16),
              ("q8f/block32:f32", 17)] if SIM else [(t, m) for t in _TC_TEXTS for m in (4, 8, 9, 17)])


@pytest.mark.parametrize("text,m", _TC_CASES)
def test_tensor_core_gemv(cuda_backend, text, m):
    """The tensor-core kernel (tc.py) for every value kind, one- and two-level scales: K leaves the
    last block a partial register set and idle warps (rows masked; 2 k-splits on the simulator,
    8 on a GPU, where the last warps also get a partial register set); M = 9 takes two groups
    of 8 rows of x, M = 17 two launches of 16 rows (the second's rows past M read row M - 1 and
    are not written). Results within the conformance suite's matmul bound of
    x @ dequantize(w), and they repeat bit for bit."""
    from qcore_cuda import tc

    k_ = 68 if SIM else 8000 + 12
    n_ = 64 if SIM else 1024
    sch = qcore.scheme(text)
    assert tc.geometry((k_, n_), sch) is not None and tc.use_for(m)
    w = sample_x((k_, n_), seed=21)
    x = sample_x((m, k_), seed=22, scale=1.0)
    x.reshape(-1)[2] = 0.25  # (_x's 1e-30 would send its blocks to the FFMA fallback)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    W = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    want = x.astype(np.float64) @ W
    bound = _matmul_bound(x, W)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{int((err > bound).sum())} outputs past the bound, worst {np.max(err / bound):.3g}x"
    if not SIM:  # (the k-split sums' order is the GPU's: the simulator's threads take turns)
        again = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
        np.testing.assert_array_equal(again.view(np.uint32), got.view(np.uint32))


@pytest.mark.parametrize("mg,u", [(1, 2), (2, 4)])
def test_tensor_core_steps_per_set(cuda_backend, mg, u):
    """The tensor-core kernel with other steps per register set than the default (u = 2 and 4:
    a lane's scales and x of its rows in 16-byte vector loads also on the simulator, whose
    default u = 1 takes 8-byte ones) sums to x @ dequantize(w) within the matmul bound, without
    the range fallback; K leaves a partial last register set."""
    from qcore_cuda import tc

    m = 6 if mg == 1 else 13
    k_, n_ = (136 + 12, 64) if SIM else (4000 + 12, 512)
    text = "q4s/block32:f16"
    x = sample_x((m, k_), seed=25, scale=1.0)
    x.reshape(-1)[2] = 0.25
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(sample_x((k_, n_), seed=26), text)))
    kind, Q = tc.geometry(qw.data.shape, qw.data.scheme)
    q, grid, block = tc.plan(Q, 1)
    part = cuda.device_array(int(q[tc.Q_KS]) * tc.MAX_MB * n_, dtype=np.float32)
    cnt = cuda.to_device(np.zeros(grid[0] + 1, dtype=np.int32))
    kern = cuda.jit(tc._tc_kernel(kind, mg, 1, u))
    got = _launch_gemv_kernel(cuda_backend, qw, kern, grid, block, part, cnt, q, x, m, n_, tc=True)
    W = REF.dequantize(REF.from_data(cuda_backend.into_data(qw))).astype(np.float64)
    assert np.all(np.abs(got - x.astype(np.float64) @ W) <= _matmul_bound(x, W))
    assert cnt.copy_to_host()[-1] == 0


def test_tensor_core_needs_k_multiple_of_4(cuda_backend):
    """K not a multiple of 4 (the kernel's vector loads of a lane's rows) leaves M >= 4 to the
    FFMA GEMV kernel, with the same results within the bound."""
    from qcore_cuda import gemv, tc

    k_, n_, m = (66, 64, 5) if SIM else (4001, 256, 5)
    text = "q4s/block32:f16"
    kind, Q = gemv.geometry((k_, n_), qcore.scheme(text))
    assert not tc.applies(Q) and tc.applies(gemv.geometry((-(-k_ // 4) * 4, n_), qcore.scheme(text))[1])
    x = sample_x((m, k_), seed=29, scale=1.0)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(sample_x((k_, n_), seed=30), text)))
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    W = REF.dequantize(REF.quantize(sample_x((k_, n_), seed=30), text)).astype(np.float64)
    assert np.all(np.abs(got - x.astype(np.float64) @ W) <= _matmul_bound(x, W))


@pytest.mark.parametrize("case", ["tiny", "huge", "nan", "inf", "zero_rows"])
def test_tensor_core_gemv_range_fallback(cuda_backend, case):
    """Where x * e leaves [2**-100, 2**100] (subnormal x, huge products, NaN, infinity), the block
    recomputes its sums with FFMA in k order: results within the matmul bound of the f64 sum,
    NaN and infinity where the f32 sum has them, and the kernel's fallback flag set (not for
    zero rows of x, whose sums are exact zeros on the tensor cores)."""
    k_, n_, m = (72, 32, 5) if SIM else (4096 + 8, 1024, 5)
    w = sample_x((k_, n_), seed=23)
    x = sample_x((m, k_), seed=24, scale=1.0)
    if case == "tiny":
        x = (x * 1e-39).astype(np.float32)  # subnormal: x * e far below 2**-100
    elif case == "huge":
        x = (x * 2.0 ** 110).astype(np.float32)
    elif case == "nan":
        x[1, 7] = np.nan
    elif case == "inf":
        x[2, k_ - 1] = np.inf
    else:
        x[[0, 3]] = 0.0
    text = "q4s/block32:f32"
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    # the kernel itself: which blocks fell back (the flag after the column-block counters)
    from qcore_cuda import tc

    kind, Q = tc.geometry(qw.data.shape, qw.data.scheme)
    kern, mb, q, grid, block, part, cnt = tc.buffers(Q, kind, m)
    direct = _launch_gemv_kernel(cuda_backend, qw, kern, grid, block, part, cnt, q, x, m, n_, tc=True)
    assert cnt.copy_to_host()[-1] == (0 if case == "zero_rows" else 1), "fallback flag"
    got = direct.astype(np.float64)
    if not SIM:  # the backend's call launches the same kernel (the simulator would take minutes twice)
        got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw)).astype(np.float64)
        np.testing.assert_array_equal(direct.view(np.uint32), got.astype(np.float32).view(np.uint32))
    W = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (x.astype(np.float64) @ W).astype(np.float32).astype(np.float64)
        bound = _matmul_bound(x, W)
    assert_f32_sums(got, want, bound, case)
    if case == "zero_rows":
        assert np.all(got[[0, 3]] == 0)
