"""The `cuda` backend's quantize, dequantize and from_data against the reference, bit for bit
(docs/spec.md, arithmetic and portable bytes): every value, scale level and store on ragged
shapes, explicit parameters, non-finite input, input dtypes and device arrays."""
from __future__ import annotations

import numpy as np
import pytest

import qcore
from qcore import QParams, QuantizedData
from qcore.errors import InputError, UnsupportedSchemeError
from qcore.backend.reference import ReferenceBackend

from tests.cuda_cases import FLOAT_VALUES, INT_VALUES, SCALE_DTYPES, SCHEMES, SIM, bit_exact_cases, sample_x, assert_same_bytes, assert_same_floats

REF = ReferenceBackend()
# numba after conftest.py has chosen the simulator or the GPU.
from numba import cuda  # noqa: E402


# ----------------------------------------------------------------------------- bit-exactness
@pytest.mark.parametrize("text, shape", bit_exact_cases())
def test_quantize_dequantize_bit_exact(cuda_backend, text, shape):
    """Calibrate + quantize: payload bytes (codes, scales, global) identical to the reference;
    dequantize: identical float32 bits (docs/spec.md, arithmetic and portable bytes)."""
    x = sample_x(shape, seed=len(text) + sum(shape))
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
    """absmean (mean |x|, f64 sum, one f32 rounding) per block and per tensor (docs/spec.md, calibration)."""
    x = sample_x((6, 70), seed=3)
    got = cuda_backend.into_data(cuda_backend.quantize(x, text, method="absmean"))
    want = REF.into_data(REF.quantize(x, text, method="absmean"))
    assert_same_bytes(got.payload, want.payload, f"absmean payload of {text}")
    assert cuda_backend.calibrate(x, text, method="absmean") == REF.calibrate(x, text, method="absmean")


@pytest.mark.parametrize("sdt", SCALE_DTYPES)
@pytest.mark.parametrize("exp", [-140, -128, -100, -20, -8, 0, 12, 20, 100, 126])
def test_scale_round_up_across_magnitudes(cuda_backend, sdt, exp):
    """Scales from 2**-140 to 2**126 hit every round-up branch: subnormal grids, clamps at the
    dtype max, UE8M0's 2**-127 floor (docs/spec.md, scale storage)."""
    x = (sample_x((4, 64), seed=exp + 200, scale=1.0).astype(np.float64) * 2.0 ** exp).astype(np.float32)
    for text in (f"q8s/block32:{sdt}", f"e4m3/tensor:{sdt}"):
        got = cuda_backend.calibrate(x, text)
        want = REF.calibrate(x, text)
        assert got == want, f"{text} at 2**{exp}: cuda {got.scales.ravel()[:4]}, reference {want.scales.ravel()[:4]}"


def _magnitudes_and_midpoints(value: str) -> tuple:
    """(traits, every representable magnitude, the midpoints between neighbours) of a value."""
    t = qcore.scheme(value).traits
    if t.is_float:
        mags = t.magnitudes.astype(np.float64)
    else:
        mags = np.arange(0, max(abs(t.qmin), t.qmax) + 1, dtype=np.float64)
    return t, mags, (mags[1:] + mags[:-1]) / 2


@pytest.mark.parametrize("value", INT_VALUES + FLOAT_VALUES)
def test_every_code_and_midpoint(cuda_backend, value):
    """With scale 1, y = x: every representable value, every midpoint between neighbours (ties
    to even), values beyond max (saturate), and -0 encode exactly as the reference (docs/spec.md,
    quantize)."""
    t, mags, mids = _magnitudes_and_midpoints(value)
    pts = np.concatenate([mags, mids, mids * (1 + 1e-6), mids * (1 - 1e-6), [t.qmax * 1.01, t.qmax * 9]])
    x = np.concatenate([pts, -pts, [-0.0]]).astype(np.float32)
    text = f"{value}/packed_native" if t.bits < 8 else value
    p = QParams(np.float32(1.0))
    got = cuda_backend.into_data(cuda_backend.quantize(x, text, params=p))
    want = REF.into_data(REF.quantize(x, text, params=p))
    assert_same_bytes(got.payload, want.payload, f"codes of {value}")


@pytest.mark.parametrize("value", INT_VALUES + FLOAT_VALUES)
def test_every_code_and_midpoint_on_the_fast_layout(cuda_backend, value):
    """The same points as above on the fast kernels' layout (lines of whole runs of 16, padded
    with zeros): given scale 1, and calibrated per-tensor and two-level scales that are powers
    of two (a line's max |x| is qmax, or 6 for E2M1), so each point stays exact after the
    division: every code, every tie (to even) and its neighbours (docs/spec.md, quantize)."""
    from qcore_cuda import fast

    t, mags, mids = _magnitudes_and_midpoints(value)
    near = np.concatenate([np.nextafter(mids.astype(np.float32), np.float32(0)),
                           np.nextafter(mids.astype(np.float32), np.float32(np.inf))])
    pts = np.concatenate([mags, mids, near, [t.qmax * 1.01, t.qmax * 9]])
    row = np.concatenate([pts, -pts, [-0.0]]).astype(np.float32)
    row = np.concatenate([row, np.zeros(-len(row) % 64, np.float32)])
    x = np.stack([row, np.where(np.abs(row) <= t.qmax, row, 0).astype(np.float32)])  # line 2: max |x| = qmax
    packed = "/packed_native" if t.bits < 8 else ""
    for text, p in ((f"{value}{packed}", QParams(np.float32(1.0))), (f"{value}/tensor:f32{packed}", None),
                    (f"{value}/block16:ue8m0{packed}", None)):
        assert fast.geometry(x.shape, qcore.scheme(text)) is not None, text
        xs = x[1:] if p is None else x  # calibrated: the line whose max is qmax (scale 1)
        got = cuda_backend.into_data(cuda_backend.quantize(xs, text, params=p))
        want = REF.into_data(REF.quantize(xs, text, params=p))
        assert_same_bytes(got.payload, want.payload, f"codes of {text} on the fast layout")


@pytest.mark.parametrize("text", ["q8s/block32:f16", "q4s/tensor:ue4m3", "e2m1/block16:ue4m3/tensor:f32/packed_native",
                                  "q2s/block2x4:bf16/packed_u32:1", "e5m2/block8:ue8m0"])
def test_explicit_params(cuda_backend, text):
    """Explicit params (rounded up by the core) quantize exactly as the reference, including a zero
    scale (every code is the encoding of 0) and a two-level global (docs/spec.md, scale
    storage to quantize)."""
    x = sample_x((5, 37), seed=11)
    cal = REF.calibrate(x, text)
    s = np.asarray(cal.scales, np.float32) * np.float32(0.7)
    s.reshape(-1)[0] = 0.0
    g = None if cal.global_scale is None else cal.global_scale * 1.3
    p = QParams(s, g)
    got = cuda_backend.into_data(cuda_backend.quantize(x, text, params=p))
    want = REF.into_data(REF.quantize(x, text, params=p))
    assert_same_bytes(got.payload, want.payload, f"payload of {text} with explicit params")


def test_lookup_is_rejected(cuda_backend):
    """LOOKUP values are declared unsupported, and every entry point refuses them before touching
    data (docs/spec.md, backends)."""
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
    x = sample_x((6, 40), seed=5)
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
    x = sample_x((5, 70), seed=2).astype(dt)
    for text in ("q4s/block32:f16", "e4m3/tensor:f32"):
        got = cuda_backend.into_data(cuda_backend.quantize(x, text))
        assert_same_bytes(got.payload, REF.into_data(REF.quantize(x, text)).payload, f"{text} from {dtype}")


def test_device_array_inputs_are_not_copied(cuda_backend):
    """Device arrays (numba here; CuPy/torch through __cuda_array_interface__) are read in place;
    float16/float64 device arrays are converted on the device."""

    x = sample_x((5, 70), seed=8)
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
    reference (docs/spec.md, invalid codes); with those replaced, from_data keeps the bytes and
    dequantize matches the reference in every output dtype (docs/spec.md, dequantize and portable
    bytes)."""
    import ml_dtypes

    from qcore.conformance.invalid import with_valid_codes

    rng = np.random.default_rng(4)
    x = sample_x(shape, seed=4)
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


@pytest.mark.skipif(SIM, reason="needs a real GPU with ~24 GB free: 2**31 + 40 elements")
def test_more_than_2_31_elements(cuda_backend):
    """64-bit indexing: a tensor of 2**31 + 40 elements quantizes and dequantizes correctly at
    its far end (the pattern repeats every 64 elements, so the tail's expected bytes are known)."""

    n = 2**31 + 40
    pattern = sample_x((64,), seed=12)
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
