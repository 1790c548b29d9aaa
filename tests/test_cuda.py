"""The `cuda` backend (backends/cuda) against the reference, bit for bit (SPEC §2, §3).

CI runs this on Numba's CUDA simulator (tests/conftest.py), with small tensors: the simulator
pays per launched thread. On a GPU (`NUMBA_ENABLE_CUDASIM=0`) the same tests also run larger
shapes and a tensor of more than 2**31 elements. `test_kernels_compile_for_sm90` compiles every
kernel with every signature the backend uses for a real GPU (no driver needed).

Test ids are the scheme text plus the shape, e.g. `q4s/block32:f16-(5, 70)`.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import qcore
from qcore import QParams, QuantizedData
from qcore.errors import InputError, UnsupportedSchemeError
from qcore.reference import ReferenceBackend

REF = ReferenceBackend()
# A kernel defined here must see numba.cuda as a module global: the simulator swaps the module
# for its fake one in a kernel's globals, not in its closure (conftest.py has set the mode).
from numba import cuda  # noqa: E402
SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "0") not in ("", "0")

INT_VALUES = ["q8f", "q8s", "q4f", "q4s", "q2f", "q2s"]
FLOAT_VALUES = ["e4m3", "e5m2", "e2m1"]
SCALE_DTYPES = ["f32", "f16", "bf16", "ue8m0", "ue4m3"]


def _levels():
    """Scale levels: per-tensor in every dtype, block32 in every dtype, a 2-D block, two-level."""
    out = [""] + [f"tensor:{d}" for d in SCALE_DTYPES if d != "f32"]
    out += [f"block32:{d}" for d in SCALE_DTYPES]
    out += ["block4x8:bf16", "block3:f32", "block16:ue4m3/tensor:f32", "block16:f16/tensor:f32"]
    return out


def _stores(value):
    if qcore.scheme(value).bits == 8:
        return [""]
    return ["", "packed_native", "packed_u32:1", "packed_native:1"]


def _schemes():
    out = []
    for v in INT_VALUES + FLOAT_VALUES:
        for lv in _levels():
            for st in _stores(v):
                out.append("/".join(p for p in (v, lv, st) if p))
    return out


SCHEMES = _schemes()
# Shapes, picked on purpose: ragged lengths (not multiples of 8, 16 or 32), partial edge blocks
# on every blocked axis, rank 1 to 4, a single element, and empty tensors (no launch at all).
SHAPES_A = [(5, 70), (3, 4, 33), (2, 3, 5, 17), (33, 9), (6, 40)]
SHAPES_B = [(70,), (1, 1), (0, 8), (3, 1), (7, 0, 3), (129,)]
# On a GPU the same schemes also run these (more than one wave of runs, odd extents).
SHAPES_GPU = [(257, 1031), (4, 33, 130)]


def _fits(shape, text):
    s = qcore.scheme(text)
    rank = len(shape)
    if s.block is not None and len(s.block.dims) > rank:
        return False
    return s.store.dim < rank


def _cases():
    cases = []
    for i, text in enumerate(SCHEMES):
        picks = [SHAPES_A[i % len(SHAPES_A)], SHAPES_B[i % len(SHAPES_B)]]
        if not SIM:
            picks += SHAPES_GPU
        for shape in picks:
            if not _fits(shape, text):
                shape = (6, 40)
            cases.append(pytest.param(text, shape, id=f"{text}-{shape}"))
    return cases


def _x(shape, seed=0, scale=3.0):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * scale).astype(np.float32)
    if x.size > 3:  # exact zeros, a tiny value and an exact tie to exercise rounding edges
        flat = x.reshape(-1)
        flat[0] = 0.0
        flat[1] = -0.0
        flat[2] = np.float32(1e-30)
    return x


def assert_same_bytes(got: bytes, want: bytes, what: str) -> None:
    """Bit-exact comparison; on failure: count of differing bytes, the first index, both values."""
    a, b = np.frombuffer(got, np.uint8), np.frombuffer(want, np.uint8)
    if a.shape != b.shape:
        pytest.fail(f"{what}: {a.size} bytes, reference has {b.size}")
    bad = np.flatnonzero(a != b)
    if bad.size:
        i = int(bad[0])
        pytest.fail(f"{what}: {bad.size} of {a.size} bytes differ; first at byte {i}: "
                    f"cuda 0x{a[i]:02x}, reference 0x{b[i]:02x}")


def assert_same_floats(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Equal bit patterns, except that any NaN equals any NaN (NaN codes of E4M3/E5M2)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    ub = {2: np.uint16, 4: np.uint32, 8: np.uint64}[got.dtype.itemsize]
    g, w = got.reshape(-1), want.reshape(-1)
    gn, wn = np.isnan(g.astype(np.float64)), np.isnan(w.astype(np.float64))
    bad = np.flatnonzero((g.view(ub) != w.view(ub)) & ~(gn & wn))
    if bad.size:
        i = int(bad[0])
        pytest.fail(f"{what}: {bad.size} of {g.size} values differ; first at flat index {i}: "
                    f"cuda {g[i]!r} (0x{int(g.view(ub)[i]):x}), reference {w[i]!r} (0x{int(w.view(ub)[i]):x})")


# ----------------------------------------------------------------------------- bit-exactness
@pytest.mark.parametrize("text, shape", _cases())
def test_quantize_dequantize_bit_exact(cuda_backend, text, shape):
    """Calibrate + quantize: payload bytes (codes, scales, global) identical to the reference;
    dequantize: identical float32 bits (SPEC §2, §3)."""
    x = _x(shape, seed=len(text) + sum(shape))
    q = cuda_backend.quantize(x, text)
    d = cuda_backend.into_data(q)
    want = REF.into_data(REF.quantize(x, text))
    assert_same_bytes(d.payload, want.payload, f"payload of {text} on {shape}")
    y = cuda_backend.dequantize(q)
    assert not isinstance(y, np.ndarray), "dequantize returns a device array"
    assert_same_floats(cuda_backend.to_numpy(y), REF.dequantize(REF.from_data(want)), "dequantize")


@pytest.mark.parametrize("text", ["q8s", "q4s/block32:f16", "e2m1/block16:ue4m3/tensor:f32/packed_native",
                                  "q2f/block4x8:ue8m0/packed_u32:1", "e5m2/tensor:bf16"])
def test_absmean_calibration(cuda_backend, text):
    """absmean (mean |x|, f64 sum, one f32 rounding) per block and per tensor (SPEC §2.1)."""
    x = _x((6, 70), seed=3)
    got = cuda_backend.into_data(cuda_backend.quantize(x, text, method="absmean"))
    want = REF.into_data(REF.quantize(x, text, method="absmean"))
    assert_same_bytes(got.payload, want.payload, f"absmean payload of {text}")
    assert cuda_backend.calibrate(x, text, method="absmean") == REF.calibrate(x, text, method="absmean")


@pytest.mark.parametrize("sdt", SCALE_DTYPES)
@pytest.mark.parametrize("exp", [-140, -128, -100, -20, -8, 0, 12, 20, 100, 126])
def test_scale_round_up_across_magnitudes(cuda_backend, sdt, exp):
    """Scales from 2**-140 to 2**126 hit every round-up branch: subnormal grids, clamps at the
    dtype max, UE8M0's 2**-127 floor (SPEC §2.3)."""
    x = (_x((4, 64), seed=exp + 200, scale=1.0).astype(np.float64) * 2.0 ** exp).astype(np.float32)
    for text in (f"q8s/block32:{sdt}", f"e4m3/tensor:{sdt}"):
        got = cuda_backend.calibrate(x, text)
        want = REF.calibrate(x, text)
        assert got == want, f"{text} at 2**{exp}: cuda {got.scales.ravel()[:4]}, reference {want.scales.ravel()[:4]}"


@pytest.mark.parametrize("value", INT_VALUES + FLOAT_VALUES)
def test_every_code_and_midpoint(cuda_backend, value):
    """With scale 1, y = x: every representable value, every midpoint between neighbours (ties
    to even), values beyond max (saturate), and -0 encode exactly as the reference (SPEC §2.5)."""
    t = qcore.scheme(value).traits
    if t.is_float:
        mags = t.magnitudes.astype(np.float64)
    else:
        mags = np.arange(0, max(abs(t.qmin), t.qmax) + 1, dtype=np.float64)
    mids = (mags[1:] + mags[:-1]) / 2
    pts = np.concatenate([mags, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), [t.qmax * 1.01, t.qmax * 9]])
    x = np.concatenate([pts, -pts, [-0.0]]).astype(np.float32)
    text = f"{value}/packed_native" if t.bits < 8 else value
    p = QParams(np.float32(1.0))
    got = cuda_backend.into_data(cuda_backend.quantize(x, text, params=p))
    want = REF.into_data(REF.quantize(x, text, params=p))
    assert_same_bytes(got.payload, want.payload, f"codes of {value}")


@pytest.mark.parametrize("text", ["q8s/block32:f16", "q4s/tensor:ue4m3", "e2m1/block16:ue4m3/tensor:f32/packed_native",
                                  "q2s/block2x4:bf16/packed_u32:1", "e5m2/block8:ue8m0"])
def test_explicit_params(cuda_backend, text):
    """Explicit params (rounded up by the core) quantize exactly as the reference, including a zero
    scale (every code is the encoding of 0) and a two-level global (SPEC §2.3-2.5)."""
    x = _x((5, 37), seed=11)
    cal = REF.calibrate(x, text)
    s = np.asarray(cal.scales, np.float32) * np.float32(0.7)
    s.reshape(-1)[0] = 0.0
    g = None if cal.global_scale is None else cal.global_scale * 1.3
    p = QParams(s, g)
    got = cuda_backend.into_data(cuda_backend.quantize(x, text, params=p))
    want = REF.into_data(REF.quantize(x, text, params=p))
    assert_same_bytes(got.payload, want.payload, f"payload of {text} with explicit params")


@pytest.mark.parametrize("text", ["q4s/block32:f16", "e4m3/block16:ue8m0", "q2f/block8:bf16/packed_native"])
def test_row_kernel_one_pass_mode(cuda_backend, text):
    """The row kernel's one-pass mode (block max by lane groups, scale, codes) gives the
    reference bytes. The backend routes these schemes to the tile kernel, so this test launches
    the mode directly."""

    from qcore_cuda import _plan
    from qcore_cuda import kernels as K

    x = _x((5, 70), seed=21)
    pl = _plan.plan(x.shape, qcore.scheme(text))
    assert pl.RP is not None and pl.rows_fused
    rp = pl.RP.copy()
    rp[K.R_MODE] = K.ROW_FUSED
    payload = cuda.device_array(pl.total_nbytes, dtype=np.uint8)
    words = payload[: pl.values_nbytes]
    if pl.P[K.M_WB] == 4:
        words = words.view(np.uint32)
    grid, tpb = K.launch_rows(*pl.rows_shape)
    K.k_rows_quant[grid, tpb](
        cuda.to_device(x.reshape(-1)), cuda.to_device(rp), cuda.to_device(pl.F),
        cuda.device_array(pl.nslots, dtype=np.float32), cuda.to_device(np.zeros(4, np.float32)), words, payload,
        cuda.to_device(np.zeros(1, np.int32)), cuda.device_array(pl.nslots, dtype=np.float32))
    want = REF.into_data(REF.quantize(x, text)).payload
    assert_same_bytes(payload.copy_to_host().tobytes(), want, f"row kernel one-pass payload of {text}")


def test_lookup_is_rejected(cuda_backend):
    """LOOKUP values are declared unsupported, and every entry point refuses them before touching
    data (SPEC §4)."""
    sup = cuda_backend.supports("nf4")
    assert not sup and "LOOKUP" in sup.reason
    with pytest.raises(UnsupportedSchemeError, match=r"backend 'cuda' does not support q4s-lookup\[nf4\]"):
        cuda_backend.quantize(np.ones((4, 64), np.float32), "nf4")
    with pytest.raises(UnsupportedSchemeError, match="does not support"):
        cuda_backend.from_data(REF.into_data(REF.quantize(np.ones(64, np.float32), "nf4")))
    assert all(cuda_backend.supports(s) for s in SCHEMES)


@pytest.mark.parametrize("text", ["q8s", "q4s/block32:f16", "e2m1/block16:ue4m3/tensor:f32/packed_native",
                                  "q2s/block4x8:f32/packed_u32:1"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_input_raises(cuda_backend, text, bad):
    """NaN/Inf anywhere raises InputError naming the first bad index, on every kernel path."""
    x = _x((6, 40), seed=5)
    x[4, 33] = bad
    x[5, 1] = bad
    with pytest.raises(InputError, match=r"index \(4, 33\)"):
        cuda_backend.quantize(x, text)
    with pytest.raises(InputError, match=r"index \(4, 33\)"):
        cuda_backend.calibrate(x, text)
    with pytest.raises(InputError, match=r"index \(4, 33\)"):
        cuda_backend.quantize(x, text, params=REF.calibrate(np.zeros_like(x), text))


@pytest.mark.parametrize("dtype", ["float16", "float64", "bfloat16"])
def test_input_dtypes(cuda_backend, dtype):
    """float16/bfloat16/float64 inputs are converted to float32 first, as the reference does."""
    import ml_dtypes

    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    x = _x((5, 70), seed=2).astype(dt)
    for text in ("q4s/block32:f16", "e4m3/tensor:f32"):
        got = cuda_backend.into_data(cuda_backend.quantize(x, text))
        assert_same_bytes(got.payload, REF.into_data(REF.quantize(x, text)).payload, f"{text} from {dtype}")


def test_device_array_inputs_are_not_copied(cuda_backend):
    """Device arrays (numba here; CuPy/torch through __cuda_array_interface__) are read in place;
    float16/float64 device arrays are converted on the device."""

    x = _x((5, 70), seed=8)
    want = REF.into_data(REF.quantize(x, "q4s/block32:f16")).payload
    for dt in (np.float32, np.float16, np.float64):
        xd = cuda.to_device(x.astype(dt))
        got = cuda_backend.into_data(cuda_backend.quantize(xd, "q4s/block32:f16"))
        if dt == np.float32:
            assert_same_bytes(got.payload, want, "payload from a float32 device array")
        else:
            ref = REF.into_data(REF.quantize(x.astype(dt), "q4s/block32:f16")).payload
            assert_same_bytes(got.payload, ref, f"payload from a {np.dtype(dt)} device array")


@pytest.mark.parametrize("text", ["q8f/block32:bf16", "q4f/block2x16:f16/packed_native", "e4m3/block4:ue8m0",
                                  "e2m1/block16:ue4m3/tensor:f32/packed_u32:1", "q2f/tensor:ue4m3", "e5m2/block32:f16",
                                  "q4s/block16:f16", "nvfp4"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64", "bfloat16"])
@pytest.mark.parametrize("shape", [(6, 37), (4, 64)])  # (4, 64): the fast path where the layout allows
def test_from_data_decodes_any_payload(cuda_backend, text, dtype, shape):
    """Random codes (every bit pattern) and random valid scales: a code outside the value's set
    (Q4S -8, E4M3/E5M2 NaN/Inf) raises InvalidDataError naming the same first element as the
    reference (SPEC v1.1 §3); with those replaced, from_data keeps the bytes and dequantize matches
    the reference in every output dtype (SPEC §2.6, §3)."""
    import ml_dtypes

    from qcore.conformance.invalid import with_valid_codes

    rng = np.random.default_rng(4)
    x = _x(shape, seed=4)
    d0 = REF.into_data(REF.quantize(x, text))
    sch = d0.scheme
    hi = 1 << sch.bits
    codes = rng.integers(0, hi, size=shape).astype(np.int64)
    if not sch.traits.is_float:
        codes = np.where(codes >= hi // 2, codes - hi, codes)
    scales = d0.scales() * rng.uniform(0.5, 4, d0.scales().shape).astype(np.float32)
    scales = sch.slot_dtype.traits.store(scales.astype(np.float32))
    data = QuantizedData.from_parts(shape, sch, codes.astype(sch.code_dtype), scales, d0.global_scale())
    dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.dtype(dtype)
    bad = data.first_invalid_code()
    if bad is not None:
        with pytest.raises(qcore.InvalidDataError, match=rf"element \({bad[0]}, {bad[1]}\) of"):
            cuda_backend.dequantize(cuda_backend.from_data(data), dtype=dt)
        values = with_valid_codes(data.values_bytes(), shape, sch, rng)
        data = QuantizedData(shape, sch, values + data.payload[len(values):])
    q = cuda_backend.from_data(data)
    assert cuda_backend.into_data(q) == data
    got = cuda_backend.to_numpy(cuda_backend.dequantize(q, dtype=dt))
    assert_same_floats(got, REF.dequantize(REF.from_data(data), dtype=dt), f"dequantize to {dtype}")


@pytest.mark.parametrize("text", ["q8s", "q8s/block32:f16", "q4s/block32:f16", "q4f/block8x4:bf16/packed_u32:1",
                                  "e4m3/block32:f32", "e2m1/block16:ue4m3/tensor:f32/packed_native",
                                  "q2s/block16:ue8m0/packed_native:1", "e5m2/tensor:ue4m3"])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("n_", [37, 40, 64])
def test_fused_matmul(cuda_backend, text, m, n_):
    """x [M, K] @ w [K, N] with w dequantized inside the kernel equals x @ dequantize(w) (f32
    accumulation, so to rounding). K spans several k-chunks; N = 37 leaves a partial column group
    (per-code path for Native), N = 40 takes the word-per-thread path, N = 64 (512 on a GPU) the
    GEMV kernel for the last-axis layouts, whose results repeat bit for bit."""
    k_ = 70 if SIM else 1000
    n_ = n_ if SIM else n_ * 8 + n_ % 8
    w = _x((k_, n_), seed=9)
    x = _x((m, k_), seed=10, scale=1.0)
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


@pytest.mark.parametrize("text,n_,wpt,one", [
    ("q4s/block32:f16", 64, 2, True),  # 8-byte loads, one scale per thread-row
    ("q4s/block8:bf16", 64, 2, False),  # a scale slot per word
    ("q4f/block16:f32", 48, 2, True),
    ("e2m1/block16:ue4m3/tensor:f32/packed_native", 48, 2, True),
    ("q8s/block4:f16", 48, 2, False),
    ("q2s/block16:f16", 80, 1, True),  # 5 words per row: 4-byte loads
    ("e4m3", 64, 2, True),
])
@pytest.mark.parametrize("m", [1, 2])
def test_gemv_paths(cuda_backend, text, n_, wpt, one, m):
    """Every GEMV kernel variant `config_for` picks at M = 1 (words per thread, scale slots per
    thread-row): K leaves a thread 15 rows (3 steps of 4, both register sets of the prefetch
    pipeline, and 3 single rows after them) under 2 k-splits; the results equal x @ dequantize(w)
    to rounding and repeat bit for bit."""
    from qcore_cuda import gemv

    k_ = 230 if SIM else 1000 * 8 + 23
    w = _x((k_, n_), seed=11)
    x = _x((m, k_), seed=12, scale=1.0)
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
    scales, gbuf = backend._decoded_scales(data)
    pp = backend._prepared(data.shape, data.scheme, "minmax")
    w32 = data.payload[: pp["plan"].values_nbytes].view(np.uint32)
    out = cuda.device_array(m * n_, dtype=np.float32)
    extra = []
    if tc:
        from qcore_cuda import tc as tc_

        extra = [tc_.slot_scales(scales, np.asarray(q, dtype=np.int64))]
    kern[grid, block](cuda.to_device(x.reshape(-1)), w32, scales, gbuf, pp["lut"], part, cnt, out,
                      tuple(int(v) for v in q), 0, m, *extra)
    return out.copy_to_host().reshape(m, n_)


def _matmul_bound(x, W):
    """The conformance suite's matmul bound (matmul_rel = 2): 2 K 2**-24 (|x| @ |W|)."""
    return 2 * x.shape[-1] * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(W))


_TC_TEXTS = ["q4s/block32:f16", "q8f/block32:f32", "q2s/block32:f16", "e4m3/block64:bf16", "e5m2",
             "e2m1/block32:ue8m0", "e4m3/block32:ue4m3/tensor:f32", "q4f/block64:f16/packed_native"]
# the simulator runs each mma as two block barriers: every kind once, each M on some kind
_TC_CASES = ([(t, m) for t, m in zip(_TC_TEXTS, [4, 9, 8, 6, 16, 5, 9, 17])] if SIM else
             [(t, m) for t in _TC_TEXTS for m in (4, 8, 9, 17)])


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
    w = _x((k_, n_), seed=21)
    x = _x((m, k_), seed=22, scale=1.0)
    x.reshape(-1)[2] = 0.25  # (_x's 1e-30 would send its blocks to the FFMA fallback)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(w, text)))
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    W = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    want = x.astype(np.float64) @ W
    bound = _matmul_bound(x, W)
    err = np.abs(got - want)
    assert np.all(err <= bound), f"{int((err > bound).sum())} outputs past the bound, worst {np.max(err / bound):.3g}x"
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
    x = _x((m, k_), seed=25, scale=1.0)
    x.reshape(-1)[2] = 0.25
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(_x((k_, n_), seed=26), text)))
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
    x = _x((m, k_), seed=29, scale=1.0)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(_x((k_, n_), seed=30), text)))
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw))
    W = REF.dequantize(REF.quantize(_x((k_, n_), seed=30), text)).astype(np.float64)
    assert np.all(np.abs(got - x.astype(np.float64) @ W) <= _matmul_bound(x, W))


@pytest.mark.parametrize("case", ["tiny", "huge", "nan", "inf", "zero_rows"])
def test_tensor_core_gemv_range_fallback(cuda_backend, case):
    """Where x * e leaves [2**-100, 2**100] (subnormal x, huge products, NaN, infinity), the block
    recomputes its sums with FFMA in k order: results within the matmul bound of the f64 sum,
    NaN and infinity where the f32 sum has them, and the kernel's fallback flag set (not for
    zero rows of x, whose sums are exact zeros on the tensor cores)."""
    k_, n_, m = (72, 32, 5) if SIM else (4096 + 8, 1024, 5)
    w = _x((k_, n_), seed=23)
    x = _x((m, k_), seed=24, scale=1.0)
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
    got = cuda_backend.to_numpy(cuda_backend.matmul(x, qw)).astype(np.float64)
    # the kernel itself: which blocks fell back (the flag after the column-block counters)
    from qcore_cuda import tc

    kind, Q = tc.geometry(qw.data.shape, qw.data.scheme)
    kern, mb, q, grid, block, part, cnt = tc.buffers(Q, kind, m)
    again = _launch_gemv_kernel(cuda_backend, qw, kern, grid, block, part, cnt, q, x, m, n_, tc=True)
    np.testing.assert_array_equal(again.view(np.uint32), got.astype(np.float32).view(np.uint32))
    assert cnt.copy_to_host()[-1] == (0 if case == "zero_rows" else 1), "fallback flag"
    W = REF.dequantize(REF.quantize(w, text)).astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        want = (x.astype(np.float64) @ W).astype(np.float32).astype(np.float64)
        bound = _matmul_bound(x, W)
    fin = np.isfinite(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_array_equal(got[np.isinf(want)], want[np.isinf(want)])
    assert np.all(np.abs(got[fin] - want[fin]) <= bound[fin]), case
    if case == "zero_rows":
        assert np.all(got[[0, 3]] == 0)


@pytest.mark.parametrize("kind_name", ["KIND_I4", "KIND_I2"])
def test_offset_decoder_is_exact(cuda_backend, kind_name):
    """The GEMV's offset decode (`fast.offset_decoder`): a * f + b equals every field's signed
    code, for every field value in every position of the word."""
    from numba import float32, int64, uint32

    from qcore_cuda import fast

    kind = getattr(fast, kind_name)
    bits = fast.KIND_BITS[kind]
    per = 32 // bits
    decode, a, b = fast.offset_decoder(kind)
    rng = np.random.default_rng(3)
    vals = np.arange(1 << bits, dtype=np.uint32)
    words = [sum(int(vals[(i + s) % vals.size]) << (bits * i) for i in range(per)) for s in range(vals.size)]
    words = np.array(words + list(rng.integers(0, 2**32, 64 if SIM else 4096, dtype=np.uint64)), dtype=np.uint32)

    @cuda.jit
    def k(w, out):
        val = cuda.local.array(16, float32)
        tab = cuda.shared.array(16, float32)
        i = int64(cuda.grid(1))
        if i < w.size:
            decode(uint32(w[i]), tab, val, 0)
            for c in range(per):
                out[i * int64(per) + int64(c)] = val[c]

    out = cuda.device_array(words.size * per, dtype=np.float32)
    k[(words.size + 63) // 64, 64](cuda.to_device(words), out)
    f = out.copy_to_host().reshape(words.size, per).astype(np.float64)
    fields = (words[:, None] >> (bits * np.arange(per, dtype=np.uint32))) & np.uint32((1 << bits) - 1)
    codes = np.where(fields >= 1 << (bits - 1), fields.astype(np.int64) - (1 << bits), fields)
    np.testing.assert_array_equal(a * f + b, codes)
    assert fast.offset_decoder(fast.KIND_I8) is None and fast.offset_decoder(fast.KIND_E2M1) is None


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q2s/block16:f16"])
def test_gemv_offset_variant(cuda_backend, text):
    """The GEMV's offset-decode tuning variant (`_gemv_kernel(offset=True)`, what
    benchmarks/gpu_tune.py times) sums to x @ dequantize(w) within 1e-4, like the default."""
    from qcore_cuda import gemv

    k_, n_ = (230, 64) if SIM else (4000, 512)
    x = _x((1, k_), seed=14, scale=1.0)
    qw = cuda_backend.from_data(REF.into_data(REF.quantize(_x((k_, n_), seed=13), text)))
    kind, Q = gemv.geometry(qw.data.shape, qw.data.scheme)
    mb, wpt, one = gemv.config_for(kind, 1, Q)
    q, grid, block = gemv.plan(Q, wpt)
    part = cuda.device_array(int(q[gemv.Q_KS]) * mb * n_, dtype=np.float32)
    cnt = cuda.to_device(np.zeros(grid[0], dtype=np.int32))
    kern = cuda.jit(gemv._gemv_kernel(kind, mb, wpt, one, offset=True))
    got = _launch_gemv_kernel(cuda_backend, qw, kern, grid, block, part, cnt, q, x, 1, n_)
    want = x.astype(np.float64) @ REF.dequantize(REF.from_data(cuda_backend.into_data(qw))).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_launches_hold_no_outputs(cuda_backend):
    """The cached launches of a tensor (dequantize, GEMV) keep no reference to the arrays a call
    passed (x, the output): a dropped output (a 1 GiB dequantize, say) is freed."""

    qw = cuda_backend.quantize(_x((64, 64), seed=9), "q4s/block32:f16")
    x = cuda.to_device(_x((1, 64), seed=10, scale=1.0))
    for _ in range(2):  # the first call packs, the second swaps
        cuda_backend.dequantize(qw)
        cuda_backend.matmul(x, qw)
        launches = [qw.data.cache["dequant"], qw.data.cache[("gemv", 1)][1]]
        for launch in launches:
            held = [launch._args[i] for i in launch._dynamic]
            assert held == [None] * len(held), "a cached launch still holds a call's arrays"


@pytest.mark.skipif(SIM, reason="packed launches bypass numba's dispatcher only on a GPU; the simulator always "
                             "takes the dispatcher (qcore_cuda/_launch.py)")
@pytest.mark.parametrize("m", [1, 5])
def test_packed_launches_repeat_results(cuda_backend, m):
    """After the first call (through numba's dispatcher), the GEMV and dequantize launches reuse
    their packed argument lists with new x / output pointers: results equal the first call's
    bit for bit, and a different x gives its own product."""

    text = "q4s/block32:f16"
    w = _x((256, 512), seed=5)
    qw = cuda_backend.quantize(w, text)
    x1, x2 = _x((m, 256), seed=6, scale=1.0), _x((m, 256), seed=7, scale=1.0)
    first = cuda_backend.to_numpy(cuda_backend.matmul(cuda.to_device(x1), qw))
    second = cuda_backend.to_numpy(cuda_backend.matmul(cuda.to_device(x2), qw))
    again = cuda_backend.to_numpy(cuda_backend.matmul(cuda.to_device(x1), qw))
    mb, launch = qw.data.cache[("gemv", m)]
    assert isinstance(launch._state, tuple), "the GEMV launch was not packed"
    np.testing.assert_array_equal(again.view(np.uint32), first.view(np.uint32))
    wd = REF.dequantize(REF.from_data(cuda_backend.into_data(qw))).astype(np.float64)
    for x, got in ((x1, first), (x2, second)):
        want = x.astype(np.float64) @ wd
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    d1 = cuda_backend.to_numpy(cuda_backend.dequantize(qw))
    d2 = cuda_backend.dequantize(qw)
    d3 = cuda_backend.dequantize(qw)
    assert isinstance(qw.data.cache["dequant"]._state, tuple), "the dequantize launch was not packed"
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
    xs = [_x((4, 256), seed=s) for s in (1, 2, 3)]
    for x in xs + xs[:1]:
        for params in (None, REF.calibrate(x, text)):
            got = be.into_data(be.quantize(cuda.to_device(x), text, params=params))
            want = REF.into_data(REF.quantize(x, text, params=params))
            assert_same_bytes(got.payload, want.payload, f"{text} (params={params is not None})")
    pp = be._prepared((4, 256), qcore.scheme(text), "minmax")
    packed = [p for k, v in pp.items() if isinstance(k, tuple) and k[0] == "fast_quant" for p in v[1]]
    assert packed and all(isinstance(p._state, tuple) for p in packed if p._state is not None)
    bad = xs[0].copy()
    bad[1, 7] = np.nan
    with pytest.raises(InputError):
        be.quantize(cuda.to_device(bad), text)
    for x in xs:
        got = be.into_data(be.quantize(cuda.to_device(x), text))
        assert_same_bytes(got.payload, REF.into_data(REF.quantize(x, text)).payload, f"{text} after a non-finite input")
    with pytest.raises(InputError):
        be.quantize(cuda.to_device(bad), text)


def test_registered_through_entry_point(cuda_backend):
    """`cuda` is found through the `qcore` entry point group, priority 30, and `auto` picks it for
    the schemes it supports but not for LOOKUP."""
    assert "cuda" in qcore.backends()
    be = qcore.backend("cuda")
    assert be.priority == 30 and be.available()
    auto = qcore.backend("auto")
    assert auto.pick("q4s/block32:f16").name == "cuda"
    assert auto.pick("nf4").name != "cuda"


def test_unavailable_without_gpu_or_simulator():
    """With CUDA disabled, the backend reports unavailable (never raises) and says why; using it
    raises BackendUnavailableError."""
    code = textwrap.dedent("""
        import numpy as np, qcore
        from qcore_cuda import CudaBackend
        be = CudaBackend()
        assert be.available() is False, be.describe()
        print("WHY:", be.describe())
        try:
            be.quantize(np.ones(4, np.float32), "q8s")
        except qcore.BackendUnavailableError as e:
            print("RAISED:", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    env["NUMBA_DISABLE_CUDA"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "WHY:" in out.stdout and "NUMBA_DISABLE_CUDA" in out.stdout
    assert "RAISED: backend 'cuda' is not available" in out.stdout


_COMPILE_ALL = textwrap.dedent("""
    import sys
    try:
        from numba import cuda
        from qcore_cuda import kernels as K, fast as F, gemv as G, tc as T
        n = 0
        newer = ("e4m3x2", "e5m2x2", "max.NaN")  # sm_89 FP8 conversions, sm_80 max.NaN
        for name, sigs in K.SIGNATURES.items():
            for sig in sigs:
                cuda.compile_ptx(getattr(K, name).py_func, sig, cc=(9, 0))
                n += 1
                # the general kernels are the path of GPUs below 8.9: nothing newer than sm_75
                ptx, _ = cuda.compile_ptx(getattr(K, name).py_func, sig, cc=(7, 5))
                for f in newer:
                    if f in ptx:
                        print("NEEDS_NEWER_GPU", name, f)
        fp8 = 0
        for name, fn, sig, *_ in F.ptx_targets() + G.ptx_targets() + T.ptx_targets():
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0))
            fp8 += "e4m3x2" in ptx
            n += 1
        print("FAST_FP8", fp8)
    except Exception as e:
        if "DynamicLibNotFoundError" in type(e).__name__ or "libnvrtc" in str(e) or "libnvvm" in str(e):
            print("NOLIBS:", type(e).__name__, e)
            sys.exit(3)
        raise
    print("COMPILED", n)
""")


def test_kernels_compile_for_sm90():
    """Every kernel with every signature the backend launches, compiled to PTX for sm_90 by the
    real (non-simulator) numba target: catches what the simulator lets through (float16 atomics,
    NumPy ufuncs in kernels, int/float promotion). The general kernels also compile for sm_75
    without sm_80/sm_89 instructions (they are the path of older GPUs). Needs the NVRTC and NVVM libraries
    (`pip install qcore-cuda[ptx]`), no GPU. Skips without them, fails under QCORE_REQUIRE_PTX=1."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_ALL], env=env, capture_output=True, text=True, timeout=600)
    if out.returncode == 3:
        reason = f"NVRTC/NVVM libraries missing (pip install qcore-cuda[ptx]): {out.stdout.strip()[:300]}"
        if os.environ.get("QCORE_REQUIRE_PTX", "") not in ("", "0"):
            pytest.fail(reason + " (QCORE_REQUIRE_PTX=1)")
        pytest.skip(reason)
    assert out.returncode == 0, out.stderr[-3000:]
    from qcore_cuda import fast as F, gemv as G, kernels as K, tc as T

    n = sum(len(s) for s in K.SIGNATURES.values()) + len(F.ptx_targets()) + len(G.ptx_targets()) + len(T.ptx_targets())
    assert f"COMPILED {n}" in out.stdout
    # the general kernels (backend.fast_verdict's path below compute capability 8.9) use no
    # sm_80+/sm_89+ instruction; the fast ones do (which is why they are gated)
    assert "NEEDS_NEWER_GPU" not in out.stdout, out.stdout
    assert "FAST_FP8 0" not in out.stdout


@pytest.mark.skipif(SIM, reason="needs a real GPU with ~24 GB free: 2**31 + 40 elements")
def test_more_than_2_31_elements(cuda_backend):
    """64-bit indexing: a tensor of 2**31 + 40 elements quantizes and dequantizes correctly at
    its far end (the pattern repeats every 64 elements, so the tail's expected bytes are known)."""

    n = 2**31 + 40
    pattern = _x((64,), seed=12)
    x = np.resize(pattern, n)
    text = "q4s/block32:f16"
    q = cuda_backend.quantize(cuda.to_device(x), text)
    want = REF.into_data(REF.quantize(pattern, text))
    tail = n % 64  # the last 40 elements: a full block and a partial one (8 of 32)
    payload = q.data.payload
    vb = -(-n // 8) * 4  # u32 words of 8 fields
    got_vals = payload[vb - 20: vb].copy_to_host()
    ref_tail = REF.into_data(REF.quantize(pattern[:tail], text))
    assert_same_bytes(got_vals.tobytes(), ref_tail.values_bytes(), "values at the tail")
    ns = -(-n // 32)
    got_sc = payload[vb + 2 * (ns - 2): vb + 2 * ns].copy_to_host()
    assert_same_bytes(got_sc.tobytes(), ref_tail.payload[len(ref_tail.values_bytes()):], "scales at the tail")
    y = cuda_backend.dequantize(q)
    ytail = y.reshape(n)[n - tail:].copy_to_host()
    assert_same_floats(ytail, REF.dequantize(REF.from_data(ref_tail)), "dequantized tail")
    del y, q
    assert want.nbytes > 0


# The fast path (qcore_cuda/fast.py): lines of whole runs of 16 elements, codes along the last
# axis, per-tensor or power-of-two blocks along the last axis. Every value, every mode (BLOCK,
# TWO, TENSOR calibrated; GIVEN for explicit params, absmean and blocks under 16), dequantize.
QUAD_LEVELS = ["", "tensor:bf16", "block16:f16", "block32:ue8m0", "block128:f32", "block4:ue4m3/tensor:f32",
               "block32:f16/tensor:f32", "block8:bf16", "block512:ue4m3", "block64:f16/tensor:f32"]
QUAD_SCHEMES = ["/".join(p for p in (v, lv, st) if p)
                for v in INT_VALUES + FLOAT_VALUES for lv in QUAD_LEVELS
                for st in ([""] if qcore.scheme(v).bits == 8 else ["", "packed_native"])]


@pytest.mark.parametrize("text", QUAD_SCHEMES)
def test_fast_path_bit_exact(cuda_backend, text):
    from qcore_cuda import fast

    shape = (2, 512)
    assert fast.geometry(shape, qcore.scheme(text)) is not None
    x = _x(shape, seed=len(text))
    x[1, 256:384] *= 1e-30  # tiny blocks: scale round-up near the bottom of each scale dtype
    for params, method in ((None, "minmax"), (REF.calibrate(x, text), "minmax"), (None, "absmean")):
        got = cuda_backend.into_data(cuda_backend.quantize(x, text, params=params, method=method))
        want = REF.into_data(REF.quantize(x, text, params=params, method=method))
        assert_same_bytes(got.payload, want.payload, f"fast payload of {text} (params={params is not None}, {method})")
    y = cuda_backend.to_numpy(cuda_backend.dequantize(cuda_backend.from_data(want)))
    np.testing.assert_array_equal(y.view(np.uint32), REF.dequantize(REF.from_data(want)).view(np.uint32))


@pytest.mark.parametrize("cc, env, usable", [((9, 0), None, True), ((8, 9), "1", True), ((12, 0), "", True),
                                             ((8, 6), None, False), ((8, 0), None, False), ((7, 5), None, False),
                                             ((9, 0), "0", False), (None, None, True), (None, "0", False)])
def test_fast_kernels_need_sm89(cc, env, usable):
    """The fast kernels use sm_89+ FP8 conversions: older GPUs (A100 = 8.0, T4 = 7.5) and
    QCORE_CUDA_FAST=0 get the general kernels, and the reason says which; the simulator (cc None)
    runs the fast kernels' twins."""
    from qcore_cuda.backend import fast_verdict

    ok, why = fast_verdict(cc, env)
    assert ok is usable
    if not usable:
        assert why.startswith("general kernels only")
        if env != "0":
            assert f"{cc[0]}.{cc[1]}" in why and "8.9" in why


# One scheme per value kind and mode of the fast layout, and a GEMV weight.
GENERAL_SCHEMES = ["q8s/block32:f16", "q4s/block32:f16", "q2f/block16:bf16/packed_native", "e4m3/block32:f32",
                   "e5m2/tensor:bf16", "nvfp4", "q8s", "q8f/block8:ue8m0", "e2m1/block32:ue8m0"]


@pytest.fixture(scope="module")
def general_backend():
    """A cuda backend that runs only the general kernels (QCORE_CUDA_FAST=0), as on a GPU below
    compute capability 8.9."""
    from qcore_cuda import CudaBackend

    old = os.environ.get("QCORE_CUDA_FAST")
    os.environ["QCORE_CUDA_FAST"] = "0"
    try:
        be = CudaBackend()
        assert be.describe().endswith("general kernels only (QCORE_CUDA_FAST=0)")
    finally:
        if old is None:
            del os.environ["QCORE_CUDA_FAST"]
        else:
            os.environ["QCORE_CUDA_FAST"] = old
    return be


@pytest.mark.parametrize("text", GENERAL_SCHEMES)
def test_general_kernels_on_the_fast_layout(cuda_backend, general_backend, text):
    """Without the fast kernels, tensors on their layout go through the general kernels: same
    bytes as reference (calibrated, given params, absmean), same dequantized bits, and a matmul
    without the GEMV kernel."""
    from qcore_cuda import fast

    shape = (4, 64)
    s = qcore.scheme(text)
    assert fast.geometry(shape, s) is not None
    assert "fast" in cuda_backend._prepared(shape, s, "minmax")  # the default backend would take the fast path
    assert "fast" not in general_backend._prepared(shape, s, "minmax")
    x = _x(shape, seed=len(text))
    for params, method in ((None, "minmax"), (REF.calibrate(x, text), "minmax"), (None, "absmean")):
        got = general_backend.into_data(general_backend.quantize(x, text, params=params, method=method))
        want = REF.into_data(REF.quantize(x, text, params=params, method=method))
        assert_same_bytes(got.payload, want.payload, f"general payload of {text} (params={params is not None}, {method})")
    want = REF.into_data(REF.quantize(x, text))
    qw = general_backend.from_data(want)
    y = general_backend.to_numpy(general_backend.dequantize(qw))
    np.testing.assert_array_equal(y.view(np.uint32), REF.dequantize(REF.from_data(want)).view(np.uint32))
    xm = _x((2, 4), seed=3, scale=1.0)
    got = general_backend.to_numpy(general_backend.matmul(xm, qw))
    assert "gemv" not in qw.data.cache  # the general matmul kernel, not gemv.py's
    ref = xm.astype(np.float64) @ REF.dequantize(REF.from_data(want)).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("offset", [0, 1, 2, 4])
@pytest.mark.parametrize("text", ["q8s/block32:f16", "nvfp4", "e4m3"])
def test_fast_path_unaligned_device_input(cuda_backend, text, offset):
    """A device view starting `offset` floats into its allocation: 16-byte aligned views take
    the fast kernels, the others the general ones; both bit-exact (on a GPU; the simulator has
    no alignment)."""

    x = _x((2, 64), seed=offset)
    base = cuda.to_device(np.concatenate([np.zeros(offset, np.float32), x.reshape(-1)]))
    view = base[offset:].reshape(2, 64)
    got = cuda_backend.into_data(cuda_backend.quantize(view, text))
    want = REF.into_data(REF.quantize(x, text))
    assert_same_bytes(got.payload, want.payload, f"{text} from a view at +{offset} floats")
    out = cuda_backend.to_numpy(cuda_backend.dequantize(cuda_backend.from_data(want)))
    np.testing.assert_array_equal(out.view(np.uint32), REF.dequantize(REF.from_data(want)).view(np.uint32))


@pytest.mark.parametrize("shape, text", [((2, 36), "q4s/block4:f16"), ((2, 64), "q4s/block2x32:f16"),
                                         ((2, 64), "q4s/packed_u32:1"), ((2, 64), "q8s/block48:f16"),
                                         ((0, 64), "q8s"), ((2, 64), "nf4")])
def test_fast_path_not_taken_when_layout_differs(shape, text):
    from qcore_cuda import fast

    assert fast.geometry(shape, qcore.scheme(text)) is None


@pytest.mark.parametrize("text", ["q4s/block32:f16", "q8s", "nvfp4", "e4m3/block32:f32", "q8s/block8:f16"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_fast_path_flags_non_finite(cuda_backend, text, bad):
    x = np.ones((2, 64), np.float32)
    x[1, 33] = bad
    with pytest.raises(InputError, match=r"(inf|nan) at index \(1, 33\)"):
        cuda_backend.quantize(x, text)
    q = cuda_backend.quantize(np.ones((2, 64), np.float32), text)  # the scratch is clean afterwards
    assert_same_bytes(cuda_backend.into_data(q).payload, REF.into_data(REF.quantize(np.ones((2, 64), np.float32), text)).payload,
                      f"{text} after a non-finite input")


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
